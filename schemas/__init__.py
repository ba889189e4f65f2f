"""Avro schemas of agl-stream events (data; see README.md in the repository)."""
