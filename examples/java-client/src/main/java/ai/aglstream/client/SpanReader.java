package ai.aglstream.client;

import com.fasterxml.jackson.core.JsonFactory;
import com.fasterxml.jackson.core.JsonGenerator;
import java.io.IOException;
import java.io.Writer;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Collection;
import java.util.HashMap;
import java.util.HashSet;
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import org.apache.avro.Schema;
import org.apache.avro.generic.GenericData;
import org.apache.avro.generic.GenericEnumSymbol;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.message.BinaryMessageDecoder;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.common.PartitionInfo;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.utils.Utils;

/**
 * Reads the spans of given rollouts: the partitions their ids hash to (murmur2, as every
 * agl-stream producer partitions) of the spans and rollouts topics, from the beginning, until
 * each rollout has finished (RolloutFinished) and every attempt of it that finished has all
 * the spans its AttemptFinished counts. Writes each span once (a runner's attempt is
 * delivered at least once) as one JSON line: the SpanRecorded record as Avro reads it,
 * unions unwrapped, uuid as text, timestamp-micros as an integer.
 */
final class SpanReader {
    private static final byte[] MARKER = {(byte) 0xC3, (byte) 0x01};
    private static final int HEADER = MARKER.length + 8;
    private static final List<String> READ = List.of("SpanRecorded", "AttemptFinished", "RolloutFinished");

    private final Settings settings;
    private final Schemas schemas;
    private final Map<String, BinaryMessageDecoder<GenericRecord>> decoders = new HashMap<>();
    private final Set<String> wanted;
    private final Set<String> finished = new HashSet<>();
    private final Map<String, Long> spanCounts = new HashMap<>(); // attempt id -> spans it emitted
    private final Map<String, Set<Long>> sequences = new HashMap<>(); // attempt id -> spans read
    private final Map<String, String> attemptOf = new HashMap<>(); // attempt id -> its rollout
    private final JsonGenerator out;
    long skipped; // records that are none of the events read here, or not agl-stream's

    SpanReader(Settings settings, Schemas schemas, Collection<String> rolloutIds, Writer out) throws IOException {
        this.settings = settings;
        this.schemas = schemas;
        this.wanted = new LinkedHashSet<>(rolloutIds);
        this.out = new JsonFactory().createGenerator(out);
        this.out.setRootValueSeparator(null);
        for (String eventType : READ) {
            Schema reader = schemas.current(eventType).schema();
            BinaryMessageDecoder<GenericRecord> decoder = new BinaryMessageDecoder<>(GenericData.get(), reader);
            for (Schemas.Version older : schemas.olderVersionsOf(eventType)) {
                decoder.addSchema(older.schema()); // bytes of an earlier release, read as now
            }
            decoders.put(eventType, decoder);
        }
    }

    /** True when every rollout was read whole before the deadline. */
    boolean read(Duration within) throws IOException {
        long deadline = System.nanoTime() + within.toNanos();
        try (KafkaConsumer<byte[], byte[]> consumer = new KafkaConsumer<>(settings.consumer())) {
            List<TopicPartition> partitions = new ArrayList<>();
            for (String shortName : List.of("rollouts", "spans")) {
                partitions.addAll(partitionsOf(consumer, settings.topic(shortName)));
            }
            consumer.assign(partitions);
            consumer.seekToBeginning(partitions);
            while (!done() && System.nanoTime() < deadline) {
                for (ConsumerRecord<byte[], byte[]> record : consumer.poll(Duration.ofMillis(200))) {
                    take(record.value());
                }
                out.flush();
            }
        }
        out.flush();
        return done();
    }

    /** What is still missing, for a message. */
    String missing() {
        List<String> parts = new ArrayList<>();
        for (String rollout : wanted) {
            if (!finished.contains(rollout)) {
                parts.add(rollout + " has not finished");
            }
        }
        spanCounts.forEach((attempt, count) -> {
            int have = sequences.getOrDefault(attempt, Set.of()).size();
            if (have < count) {
                parts.add("attempt " + attempt + " of " + attemptOf.get(attempt) + " has " + have + " of " + count + " spans");
            }
        });
        return String.join("; ", parts);
    }

    private List<TopicPartition> partitionsOf(KafkaConsumer<byte[], byte[]> consumer, String topic) {
        List<PartitionInfo> infos = consumer.partitionsFor(topic, Duration.ofSeconds(30));
        if (infos == null || infos.isEmpty()) {
            throw new IllegalStateException("no topic " + topic + " (is the topic prefix right?)");
        }
        Set<TopicPartition> out = new LinkedHashSet<>();
        for (String rollout : wanted) {
            // The default partitioner's choice for a keyed record (Kafka's, and aiokafka's).
            int partition = Utils.toPositive(Utils.murmur2(rollout.getBytes(StandardCharsets.UTF_8))) % infos.size();
            out.add(new TopicPartition(topic, partition));
        }
        return new ArrayList<>(out);
    }

    private boolean done() {
        if (!finished.containsAll(wanted)) {
            return false;
        }
        for (Map.Entry<String, Long> entry : spanCounts.entrySet()) {
            if (sequences.getOrDefault(entry.getKey(), Set.of()).size() < entry.getValue()) {
                return false;
            }
        }
        return true;
    }

    private void take(byte[] value) throws IOException {
        Schemas.Version writer = writerOf(value);
        if (writer == null || !READ.contains(writer.eventType())) {
            skipped++;
            return;
        }
        GenericRecord event = decoders.get(writer.eventType()).decode(value);
        String rollout = event.get("rollout_id").toString();
        if (!wanted.contains(rollout)) {
            return;
        }
        switch (writer.eventType()) {
            case "SpanRecorded" -> {
                String attempt = event.get("attempt_id").toString();
                attemptOf.put(attempt, rollout);
                if (sequences.computeIfAbsent(attempt, a -> new HashSet<>()).add((Long) event.get("sequence"))) {
                    write(event);
                    out.writeRaw('\n');
                }
            }
            case "AttemptFinished" -> {
                String attempt = event.get("attempt_id").toString();
                attemptOf.put(attempt, rollout);
                spanCounts.putIfAbsent(attempt, (Long) event.get("span_count"));
            }
            default -> finished.add(rollout); // RolloutFinished
        }
    }

    /** The schema the record's header names, or null when it is no single-object encoding of
     * a schema agl-stream released (agl-stream's own consumers dead-letter those). */
    private Schemas.Version writerOf(byte[] value) {
        if (value == null || value.length < HEADER || value[0] != MARKER[0] || value[1] != MARKER[1]) {
            return null;
        }
        long fingerprint = ByteBuffer.wrap(value, MARKER.length, 8).order(ByteOrder.LITTLE_ENDIAN).getLong();
        return schemas.byFingerprint(fingerprint);
    }

    private void write(Object value) throws IOException {
        if (value == null) {
            out.writeNull();
        } else if (value instanceof GenericRecord record) {
            out.writeStartObject();
            for (Schema.Field field : record.getSchema().getFields()) {
                out.writeFieldName(field.name());
                write(record.get(field.pos()));
            }
            out.writeEndObject();
        } else if (value instanceof Map<?, ?> map) {
            out.writeStartObject();
            for (Map.Entry<?, ?> entry : map.entrySet()) {
                out.writeFieldName(entry.getKey().toString());
                write(entry.getValue());
            }
            out.writeEndObject();
        } else if (value instanceof Collection<?> items) {
            out.writeStartArray();
            for (Object item : items) {
                write(item);
            }
            out.writeEndArray();
        } else if (value instanceof CharSequence || value instanceof GenericEnumSymbol<?>) {
            out.writeString(value.toString());
        } else if (value instanceof Boolean flag) {
            out.writeBoolean(flag);
        } else if (value instanceof Long number) {
            out.writeNumber(number);
        } else if (value instanceof Integer number) {
            out.writeNumber(number);
        } else if (value instanceof Double number) {
            out.writeNumber(number);
        } else if (value instanceof Float number) {
            out.writeNumber(number);
        } else {
            throw new IllegalStateException("no JSON form for " + value.getClass().getName());
        }
    }
}
