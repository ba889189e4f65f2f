"""Topic definitions as data (one TOML file per topic)."""
