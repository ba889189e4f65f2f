package ai.aglstream.client;

import java.io.IOException;
import java.nio.file.DirectoryStream;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.TreeMap;
import org.apache.avro.Schema;
import org.apache.avro.SchemaNormalization;
import org.apache.avro.SchemaParser;

/**
 * agl-stream's event schemas, read from its schemas/ folder: the current ones
 * (schemas/EVENT.avsc, shared named types in schemas/ai.aglstream.NAME.avsc) and every
 * released set (schemas/released/VERSION/EVENT.avsc, each fully expanded), by fingerprint.
 */
final class Schemas {
    static final String NAMESPACE = "ai.aglstream";

    /** One event schema and where it comes from ("current" or a release). */
    record Version(String eventType, String release, Schema schema, long fingerprint) {
        String fingerprintHex() {
            return hex(fingerprint);
        }
    }

    final Map<String, Version> current = new TreeMap<>();
    final List<Version> released = new ArrayList<>();
    private final Map<Long, Version> byFingerprint = new HashMap<>();

    static Schemas load(Path directory) throws IOException {
        if (!Files.isDirectory(directory)) {
            throw new IllegalArgumentException(
                "no schemas folder at " + directory.toAbsolutePath()
                    + " (give agl-stream's schemas/ with --schemas)");
        }
        Schemas schemas = new Schemas();
        // One parser for the folder: an event names the shared types (ai.aglstream.*.avsc),
        // which may name each other, in any order; resolve() joins them once all are read.
        SchemaParser parser = new SchemaParser();
        for (Path file : avscFiles(directory, true)) {
            parser.parse(file);
        }
        Map<Path, SchemaParser.ParseResult> events = new TreeMap<>();
        for (Path file : avscFiles(directory, false)) {
            events.put(file, parser.parse(file));
        }
        for (Map.Entry<Path, SchemaParser.ParseResult> event : events.entrySet()) {
            Schema schema = parser.resolve(event.getValue());
            schemas.add(new Version(stem(event.getKey()), "current", schema, fingerprint(schema)), true);
        }
        Path releases = directory.resolve("released");
        if (Files.isDirectory(releases)) {
            try (DirectoryStream<Path> dirs = Files.newDirectoryStream(releases, Files::isDirectory)) {
                for (Path release : dirs) {
                    for (Path file : avscFiles(release, false)) {
                        // Fully expanded: each one names its own types, so a parser of its own.
                        Schema schema = new SchemaParser().parse(file).mainSchema();
                        String name = release.getFileName().toString();
                        schemas.add(new Version(stem(file), name, schema, fingerprint(schema)), false);
                    }
                }
            }
        }
        return schemas;
    }

    /** The current schema of an event type; an error naming the folder when it is missing. */
    Version current(String eventType) {
        Version version = current.get(eventType);
        if (version == null) {
            throw new IllegalArgumentException("no schema for " + eventType + " among " + current.keySet());
        }
        return version;
    }

    /** The schema a record's fingerprint names, or null for one agl-stream never released. */
    Version byFingerprint(long fingerprint) {
        return byFingerprint.get(fingerprint);
    }

    /** Every released schema of an event type that is not its current one. */
    List<Version> olderVersionsOf(String eventType) {
        long now = current(eventType).fingerprint();
        List<Version> out = new ArrayList<>();
        for (Version version : released) {
            if (version.eventType().equals(eventType) && version.fingerprint() != now) {
                out.add(version);
            }
        }
        return out;
    }

    /** CRC-64-AVRO of the schema's Parsing Canonical Form: what single-object encoding writes. */
    static long fingerprint(Schema schema) {
        return SchemaNormalization.parsingFingerprint64(schema);
    }

    /** The fingerprint as it lies on the wire (little-endian), in hex: as Python's codec shows it. */
    static String hex(long fingerprint) {
        StringBuilder out = new StringBuilder();
        for (int i = 0; i < 8; i++) {
            out.append(String.format(Locale.ROOT, "%02x", (fingerprint >>> (8 * i)) & 0xff));
        }
        return out.toString();
    }

    private void add(Version version, boolean isCurrent) {
        if (isCurrent) {
            current.put(version.eventType(), version);
        } else {
            released.add(version);
        }
        byFingerprint.putIfAbsent(version.fingerprint(), version);
    }

    private static List<Path> avscFiles(Path directory, boolean shared) throws IOException {
        List<Path> out = new ArrayList<>();
        try (DirectoryStream<Path> files = Files.newDirectoryStream(directory, "*.avsc")) {
            for (Path file : files) {
                if (stem(file).startsWith(NAMESPACE + ".") == shared) {
                    out.add(file);
                }
            }
        }
        out.sort(null);
        return out;
    }

    private static String stem(Path file) {
        String name = file.getFileName().toString();
        return name.substring(0, name.length() - ".avsc".length());
    }
}
