package ai.aglstream.client;

import java.io.BufferedReader;
import java.io.BufferedWriter;
import java.io.IOException;
import java.io.InputStreamReader;
import java.io.OutputStreamWriter;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.Set;
import java.util.UUID;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CompletionException;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.Future;
import java.util.concurrent.atomic.AtomicReference;
import org.apache.avro.generic.GenericRecord;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.header.internals.RecordHeader;

/** agl-stream from Java: queue tasks, give rewards, read spans. See README.md. */
public final class Main {
    private static final String USAGE = String.join("\n",
        "usage: java -jar target/agl-stream-java-client.jar COMMAND [OPTIONS]",
        "",
        "  enqueue [--file TASKS.jsonl] [--mode train|val|test] [--max-attempts N]",
        "      one rollout per JSON line (standard input without --file); prints their ids",
        "  reward [--name NAME] [--attempt-id ID] [--source SOURCE] ROLLOUT_ID VALUE [ROLLOUT_ID VALUE ...]",
        "      gives each rollout a reward (RewardRecorded); prints the events' ids",
        "  spans [--timeout SECONDS] ROLLOUT_ID [ROLLOUT_ID ...]",
        "      prints the rollouts' spans as JSON lines once they have finished",
        "  fingerprints",
        "      prints each schema's release, event type and fingerprint as on the wire",
        "",
        "options of every command: --bootstrap-servers HOST:PORT (AGL_STREAM_BOOTSTRAP_SERVERS,",
        "  default 127.0.0.1:19092), --topic-prefix PREFIX (AGL_STREAM_TOPIC_PREFIX, default agl.),",
        "  --schemas DIR (agl-stream's schemas/, default ../../schemas)");
    private static final Set<String> COMMON = Set.of("--bootstrap-servers", "--topic-prefix", "--schemas");

    private Main() {}

    public static void main(String[] argv) {
        if (argv.length == 0 || argv[0].equals("--help") || argv[0].equals("-h")) {
            System.out.println(USAGE);
            System.exit(argv.length == 0 ? 2 : 0);
        }
        try {
            System.exit(run(argv[0], argv));
        } catch (IllegalArgumentException | IllegalStateException e) {
            System.err.println("agl-stream-java-client " + argv[0] + ": " + e.getMessage());
            System.exit(2);
        } catch (Exception e) {
            System.err.println("agl-stream-java-client " + argv[0] + " failed: " + e);
            System.exit(1);
        }
    }

    private static int run(String command, String[] argv) throws Exception {
        return switch (command) {
            case "enqueue" -> enqueue(args(argv, "--file", "--mode", "--max-attempts"));
            case "reward" -> reward(args(argv, "--name", "--attempt-id", "--source"));
            case "spans" -> spans(args(argv, "--timeout"));
            case "fingerprints" -> fingerprints(args(argv));
            default -> throw new IllegalArgumentException("unknown command\n" + USAGE);
        };
    }

    private static Args args(String[] argv, String... own) {
        Set<String> known = new java.util.TreeSet<>(COMMON);
        known.addAll(List.of(own));
        return new Args(argv, 1, known);
    }

    private static int enqueue(Args args) throws Exception {
        Settings settings = Settings.from(args);
        Events events = new Events(Schemas.load(settings.schemas()));
        String topic = settings.topic("tasks");
        long began = System.nanoTime();
        // The producer starts (connects, learns the topic's partitions, gets its producer id)
        // while the tasks are read and checked: a short run is mostly the client's start.
        CompletableFuture<KafkaProducer<byte[], byte[]>> opening = CompletableFuture.supplyAsync(() -> {
            KafkaProducer<byte[], byte[]> producer = new KafkaProducer<>(settings.producer());
            producer.partitionsFor(topic);
            return producer;
        });
        Tasks tasks;
        try {
            tasks = readTasks(args.option("--file"), events, args.option("--mode", "train"),
                (int) args.number("--max-attempts", 1));
        } catch (RuntimeException | IOException e) {
            opening.thenAccept(producer -> producer.close(Duration.ZERO)); // nothing was sent
            throw e;
        }
        AtomicReference<Exception> failure = new AtomicReference<>();
        try (KafkaProducer<byte[], byte[]> producer = opened(opening)) {
            for (int i = 0; i < tasks.ids().size() && failure.get() == null; i++) {
                ProducerRecord<byte[], byte[]> record =
                    record(topic, tasks.ids().get(i), tasks.values().get(i), "RolloutQueued");
                producer.send(record, (metadata, error) -> {
                    if (error != null) {
                        failure.compareAndSet(null, error);
                    }
                });
            }
            producer.flush(); // every send acknowledged (acks=all) or failed
        }
        double seconds = (System.nanoTime() - began) / 1e9;
        if (failure.get() != null) {
            throw new IllegalStateException("the broker did not take every task: " + failure.get());
        }
        PrintStream out = new PrintStream(System.out, false, StandardCharsets.UTF_8);
        tasks.ids().forEach(out::println);
        out.flush();
        System.err.printf(Locale.ROOT, "queued %d rollouts in %.3f s (%.0f/s)%n",
            tasks.ids().size(), seconds, tasks.ids().size() / Math.max(seconds, 1e-9));
        return 0;
    }

    /** Task inputs, encoded as RolloutQueued records, with their new rollout ids. */
    private record Tasks(List<String> ids, List<byte[]> values) {}

    /** Every task of the file (standard input without one), each checked: a bad line is
     * refused with its number before anything is sent. */
    private static Tasks readTasks(String file, Events events, String mode, int maxAttempts) throws IOException {
        Tasks tasks = new Tasks(new ArrayList<>(), new ArrayList<>());
        try (BufferedReader lines = file == null
                ? new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8))
                : Files.newBufferedReader(Path.of(file), StandardCharsets.UTF_8)) {
            String line;
            for (int number = 1; (line = lines.readLine()) != null; number++) {
                if (line.isBlank()) {
                    continue;
                }
                String rolloutId = "ro-" + UUID.randomUUID().toString().replace("-", "");
                try {
                    tasks.values().add(events.encode(events.rolloutQueued(rolloutId, line, mode, maxAttempts, Map.of())));
                } catch (IllegalArgumentException e) {
                    throw new IllegalArgumentException((file == null ? "<stdin>" : file) + ":" + number + ": " + e.getMessage());
                }
                tasks.ids().add(rolloutId);
            }
        }
        return tasks;
    }

    private static KafkaProducer<byte[], byte[]> opened(CompletableFuture<KafkaProducer<byte[], byte[]>> opening) {
        try {
            return opening.join();
        } catch (CompletionException e) {
            throw new IllegalStateException("no producer for the tasks topic: " + e.getCause(), e.getCause());
        }
    }

    private static int reward(Args args) throws Exception {
        Settings settings = Settings.from(args);
        Events events = new Events(Schemas.load(settings.schemas()));
        List<String> pairs = args.positional;
        if (pairs.isEmpty() || pairs.size() % 2 != 0) {
            throw new IllegalArgumentException("give ROLLOUT_ID VALUE pairs");
        }
        List<GenericRecord> rewards = new ArrayList<>();
        for (int i = 0; i < pairs.size(); i += 2) {
            double value;
            try {
                value = Double.parseDouble(pairs.get(i + 1));
            } catch (NumberFormatException e) {
                throw new IllegalArgumentException("a reward must be a number, got " + pairs.get(i + 1));
            }
            rewards.add(events.rewardRecorded(pairs.get(i), value, args.option("--name", "reward"),
                args.option("--attempt-id"), args.option("--source", "java-client")));
        }
        List<Future<RecordMetadata>> sent = new ArrayList<>();
        try (KafkaProducer<byte[], byte[]> producer = new KafkaProducer<>(settings.producer())) {
            // On the rollouts topic, keyed by rollout id: it counts when an attempt of its
            // rollout lies before it there (the same partition, by the same partitioner).
            for (GenericRecord reward : rewards) {
                String key = reward.get("rollout_id").toString();
                sent.add(producer.send(record(settings.topic("rollouts"), key, events.encode(reward), "RewardRecorded")));
            }
            for (Future<RecordMetadata> future : sent) {
                try {
                    future.get();
                } catch (ExecutionException e) {
                    throw new IllegalStateException("the broker did not take a reward: " + e.getCause());
                }
            }
        }
        rewards.forEach(r -> System.out.println(r.get("event_id")));
        return 0;
    }

    private static int spans(Args args) throws Exception {
        Settings settings = Settings.from(args);
        if (args.positional.isEmpty()) {
            throw new IllegalArgumentException("give the ids of the rollouts whose spans to read");
        }
        for (String id : args.positional) {
            Events.requireId("rollout_id", id);
        }
        Duration within = Duration.ofMillis((long) (args.number("--timeout", 60) * 1000));
        BufferedWriter out = new BufferedWriter(new OutputStreamWriter(System.out, StandardCharsets.UTF_8));
        SpanReader reader = new SpanReader(settings, Schemas.load(settings.schemas()), args.positional, out);
        if (!reader.read(within)) {
            System.err.println("agl-stream-java-client spans: not all there after " + within.toSeconds() + " s: " + reader.missing());
            return 1;
        }
        return 0;
    }

    private static int fingerprints(Args args) throws IOException {
        Schemas schemas = Schemas.load(Settings.from(args).schemas());
        for (Schemas.Version v : schemas.current.values()) {
            System.out.println(v.release() + " " + v.eventType() + " " + v.fingerprintHex());
        }
        for (Schemas.Version v : schemas.released) {
            System.out.println(v.release() + " " + v.eventType() + " " + v.fingerprintHex());
        }
        return 0;
    }

    private static ProducerRecord<byte[], byte[]> record(String topic, String key, byte[] value, String eventType) {
        // Keyed by rollout id: the default partitioner (murmur2) puts it on the partition
        // agl-stream's own producers use for that rollout, on every co-partitioned topic.
        ProducerRecord<byte[], byte[]> record = new ProducerRecord<>(topic, key.getBytes(StandardCharsets.UTF_8), value);
        record.headers().add(new RecordHeader(Events.EVENT_TYPE_HEADER, eventType.getBytes(StandardCharsets.UTF_8)));
        return record;
    }
}
