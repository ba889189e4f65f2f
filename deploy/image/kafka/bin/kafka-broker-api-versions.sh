#!/bin/sh
# compose.yaml's healthcheck: the broker answers an ApiVersions request.
KAFKA_HEAP_OPTS=-Xmx64m exec "$(dirname "$0")/kafka-run-class.sh" \
  org.apache.kafka.tools.BrokerApiVersionsCommand "$@"
