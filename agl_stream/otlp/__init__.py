"""OTLP ingestion: spans from systems that are not agl-stream runners (an application
instrumented with OpenTelemetry, an OpenTelemetry Collector), as rollouts and attempts."""
