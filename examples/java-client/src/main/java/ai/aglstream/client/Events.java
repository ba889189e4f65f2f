package ai.aglstream.client;

import com.fasterxml.jackson.core.JsonFactory;
import com.fasterxml.jackson.core.JsonParser;
import com.fasterxml.jackson.core.JsonProcessingException;
import java.io.IOException;
import java.io.UncheckedIOException;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.time.Instant;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.UUID;
import org.apache.avro.Schema;
import org.apache.avro.generic.GenericData;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.generic.GenericRecordBuilder;
import org.apache.avro.message.BinaryMessageEncoder;

/**
 * The events this client writes, built from their schemas and checked as agl-stream's
 * consumers check them (an event they would refuse goes to the dead-letter topic there):
 * ids of 1 to 256 printable characters, task inputs that are JSON, finite rewards.
 */
final class Events {
    static final int MAX_ID_LENGTH = 256;
    static final int MAX_INPUT_BYTES = 900_000; // under the broker's 1 MB record limit
    static final String EVENT_TYPE_HEADER = "agl.event_type";
    private static final JsonFactory JSON = new JsonFactory();

    private final Schema rolloutQueued;
    private final Schema rewardRecorded;
    private final BinaryMessageEncoder<GenericRecord> queuedEncoder;
    private final BinaryMessageEncoder<GenericRecord> rewardEncoder;
    private final Map<String, GenericData.EnumSymbol> modes = new LinkedHashMap<>();

    Events(Schemas schemas) {
        rolloutQueued = schemas.current("RolloutQueued").schema();
        rewardRecorded = schemas.current("RewardRecorded").schema();
        // Single-object encoding: C3 01, the schema's CRC-64-AVRO fingerprint, the Avro body.
        queuedEncoder = new BinaryMessageEncoder<>(GenericData.get(), rolloutQueued);
        Schema modeSchema = rolloutQueued.getField("mode").schema();
        for (String symbol : modeSchema.getEnumSymbols()) {
            modes.put(symbol, new GenericData.EnumSymbol(modeSchema, symbol));
        }
        rewardEncoder = new BinaryMessageEncoder<>(GenericData.get(), rewardRecorded);
    }

    /** A rollout's first attempt, queued now: what `agl-stream enqueue` writes. */
    GenericRecord rolloutQueued(String rolloutId, String inputJson, String mode, int maxAttempts,
                                Map<String, String> metadata) {
        requireId("rollout_id", rolloutId);
        requireJson(inputJson);
        if (maxAttempts < 1) {
            throw new IllegalArgumentException("max attempts must be 1 or more, got " + maxAttempts);
        }
        GenericData.EnumSymbol symbol = modes.get(mode);
        if (symbol == null) {
            throw new IllegalArgumentException("mode must be one of " + modes.keySet() + ", got " + mode);
        }
        long now = micros(Instant.now());
        // Every field set here (a GenericRecordBuilder deep-copies each default per record).
        GenericData.Record event = new GenericData.Record(rolloutQueued);
        event.put("event_id", UUID.randomUUID().toString());
        event.put("occurred_at", now);
        event.put("rollout_id", rolloutId);
        event.put("attempt_number", 1);
        event.put("input_json", inputJson);
        event.put("mode", symbol);
        event.put("resources_id", null); // no pin: the latest resources
        event.put("timeout_seconds", null);
        event.put("unresponsive_seconds", null);
        event.put("max_attempts", maxAttempts);
        event.put("retry_condition", List.of());
        event.put("metadata", metadata);
        event.put("first_queued_at", now); // attempt 1: when it was first queued is now
        event.put("previous_attempt_id", null);
        return event;
    }

    /** A reward given from outside the rollout's attempt (null attempt: the rollout as a whole). */
    GenericRecord rewardRecorded(String rolloutId, double value, String name, String attemptId,
                                 String source) {
        requireId("rollout_id", rolloutId);
        if (attemptId != null) {
            requireId("attempt_id", attemptId);
        }
        if (!Double.isFinite(value)) {
            throw new IllegalArgumentException("a reward must be a finite number, got " + value);
        }
        if (name.isEmpty() || name.length() > 200) {
            throw new IllegalArgumentException("a reward's name must have 1 to 200 characters");
        }
        return new GenericRecordBuilder(rewardRecorded)
            .set("event_id", UUID.randomUUID().toString())
            .set("occurred_at", micros(Instant.now()))
            .set("rollout_id", rolloutId)
            .set("attempt_id", attemptId)
            .set("name", name)
            .set("value", value)
            .set("source", source)
            .set("metadata", Map.of())
            .build();
    }

    byte[] encode(GenericRecord event) {
        BinaryMessageEncoder<GenericRecord> encoder =
            event.getSchema() == rolloutQueued ? queuedEncoder : rewardEncoder;
        try {
            ByteBuffer buffer = encoder.encode(event);
            byte[] out = new byte[buffer.remaining()];
            buffer.get(out);
            return out;
        } catch (IOException e) {
            throw new UncheckedIOException(e);
        }
    }

    static long micros(Instant instant) {
        return instant.getEpochSecond() * 1_000_000L + instant.getNano() / 1_000;
    }

    /** agl-stream's id rule (agl_stream/events/ids.py): 1 to 256 printable characters. */
    static void requireId(String field, String value) {
        if (value.isEmpty()) {
            throw new IllegalArgumentException(field + " must not be empty");
        }
        int length = value.codePointCount(0, value.length());
        if (length > MAX_ID_LENGTH) {
            throw new IllegalArgumentException(
                field + " must be at most " + MAX_ID_LENGTH + " characters long (it has " + length + ")");
        }
        int position = 0;
        for (int cp : (Iterable<Integer>) value.codePoints()::iterator) {
            position++;
            if (!printable(cp)) {
                throw new IllegalArgumentException(String.format(
                    "%s must hold printable characters only (character %d is U+%04X, which is not)",
                    field, position, cp));
            }
        }
    }

    /** Python's str.isprintable: no control, format, surrogate, private or unassigned code
     * point, and no separator but the ASCII space. */
    private static boolean printable(int cp) {
        if (cp == ' ') {
            return true;
        }
        return switch (Character.getType(cp)) {
            case Character.CONTROL, Character.FORMAT, Character.SURROGATE, Character.PRIVATE_USE,
                 Character.UNASSIGNED, Character.SPACE_SEPARATOR, Character.LINE_SEPARATOR,
                 Character.PARAGRAPH_SEPARATOR -> false;
            default -> true;
        };
    }

    /** One JSON value, whole (no NaN, nothing after it), at most MAX_INPUT_BYTES encoded. */
    static void requireJson(String text) {
        int bytes = text.getBytes(StandardCharsets.UTF_8).length;
        if (bytes > MAX_INPUT_BYTES) {
            throw new IllegalArgumentException(String.format(
                "task input is %,d bytes encoded, over the limit of %,d; store large inputs "
                    + "elsewhere and pass a reference", bytes, MAX_INPUT_BYTES));
        }
        try (JsonParser parser = JSON.createParser(text)) {
            if (parser.nextToken() == null) {
                throw new IllegalArgumentException("task input is empty, not JSON");
            }
            parser.skipChildren();
            if (parser.nextToken() != null) {
                throw new IllegalArgumentException("task input has text after its JSON value");
            }
        } catch (JsonProcessingException e) {
            throw new IllegalArgumentException("task input is not JSON: " + e.getOriginalMessage());
        } catch (IOException e) {
            throw new UncheckedIOException(e);
        }
    }
}
