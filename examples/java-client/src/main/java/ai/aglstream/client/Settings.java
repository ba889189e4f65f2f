package ai.aglstream.client;

import java.nio.file.Path;
import java.util.Properties;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;
import org.apache.kafka.common.serialization.ByteArraySerializer;

/**
 * Where the cluster is and how its topics are named: flags first, then agl-stream's own
 * environment variables (AGL_STREAM_BOOTSTRAP_SERVERS, AGL_STREAM_TOPIC_PREFIX), then its
 * defaults, so this client finds what `agl-stream up` started.
 */
record Settings(String bootstrapServers, String topicPrefix, Path schemas) {
    static final String CLIENT_ID = "agl-stream-java-client";

    static Settings from(Args args) {
        String servers = args.option("--bootstrap-servers",
            env("AGL_STREAM_BOOTSTRAP_SERVERS", "127.0.0.1:19092"));
        String prefix = args.option("--topic-prefix", env("AGL_STREAM_TOPIC_PREFIX", "agl."));
        if (!prefix.matches("[A-Za-z0-9._-]*")) {
            throw new IllegalArgumentException(
                "--topic-prefix may hold only letters, digits, '.', '_' and '-', got " + prefix);
        }
        return new Settings(servers, prefix, Path.of(args.option("--schemas", "../../schemas")));
    }

    /** A topic's full name: the prefix, then its short name (tasks, rollouts, spans). */
    String topic(String shortName) {
        return topicPrefix + shortName;
    }

    Properties producer() {
        Properties props = new Properties();
        props.put(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrapServers);
        props.put(ProducerConfig.CLIENT_ID_CONFIG, CLIENT_ID);
        // As agl-stream's own producers: every replica has it, a retried send is written once.
        props.put(ProducerConfig.ACKS_CONFIG, "all");
        props.put(ProducerConfig.ENABLE_IDEMPOTENCE_CONFIG, "true");
        props.put(ProducerConfig.LINGER_MS_CONFIG, "5");
        // Tasks are small (~150 bytes) and many go at once: fewer, larger requests.
        props.put(ProducerConfig.BATCH_SIZE_CONFIG, "262144");
        props.put(ProducerConfig.KEY_SERIALIZER_CLASS_CONFIG, ByteArraySerializer.class.getName());
        props.put(ProducerConfig.VALUE_SERIALIZER_CLASS_CONFIG, ByteArraySerializer.class.getName());
        return props;
    }

    Properties consumer() {
        Properties props = new Properties();
        props.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrapServers);
        props.put(ConsumerConfig.CLIENT_ID_CONFIG, CLIENT_ID);
        // Runners write through transactions: what an aborted one left must never be read.
        props.put(ConsumerConfig.ISOLATION_LEVEL_CONFIG, "read_committed");
        props.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, "false");
        props.put(ConsumerConfig.KEY_DESERIALIZER_CLASS_CONFIG, ByteArrayDeserializer.class.getName());
        props.put(ConsumerConfig.VALUE_DESERIALIZER_CLASS_CONFIG, ByteArrayDeserializer.class.getName());
        return props;
    }

    private static String env(String name, String fallback) {
        String value = System.getenv(name);
        return value == null || value.isEmpty() ? fallback : value;
    }
}
