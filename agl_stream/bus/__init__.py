"""The bus: Kafka clients, typed event streams, the Avro codec and its schemas, topic
definitions and their admin, dead letters."""
