"""agl-stream: train AI agents over an event-sourced Kafka pipeline."""

__version__ = "0.1.0"
