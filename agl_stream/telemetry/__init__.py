"""A worker's own telemetry: the spans of its units of work (spans.py) and their export, with
its metrics, by OTLP (otlp.py, when settings.py finds an endpoint)."""
