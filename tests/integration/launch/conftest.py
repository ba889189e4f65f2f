"""Trainer.fit's tests run on the test's own topics and database, configured through
AGL_STREAM_* as a user's cluster would be."""

from __future__ import annotations

import pytest

from agl_stream.runtime.config import DatabaseSettings, KafkaSettings


@pytest.fixture
def configured(
    kafka: KafkaSettings, database: DatabaseSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGL_STREAM_BOOTSTRAP_SERVERS", kafka.bootstrap_servers)
    monkeypatch.setenv("AGL_STREAM_TOPIC_PREFIX", kafka.topic_prefix)
    monkeypatch.setenv("AGL_STREAM_REPLICATION_FACTOR", str(kafka.replication_factor))
    monkeypatch.setenv("AGL_STREAM_DATABASE_URL", database.database_url.get_secret_value())
    monkeypatch.delenv("AGL_CURRENT_ROLE", raising=False)
