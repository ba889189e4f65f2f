#!/bin/sh
# Run a class from Kafka's jars, as the distribution's script of the same name does.
exec java ${KAFKA_HEAP_OPTS:-} ${KAFKA_OPTS:-} \
  -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.yaml -cp '/opt/kafka/libs/*' "$@"
