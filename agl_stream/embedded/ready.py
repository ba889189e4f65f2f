"""The embedded stack made ready for work: started unless it runs, topics and the read
model's schema applied either way (what `agl-stream demo` and `Trainer.fit` need)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from agl_stream.bus.topic_admin import apply_topics
from agl_stream.db.migrate import migrate
from agl_stream.embedded.stack import EmbeddedStack
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings, StackSettings, load


@dataclass(frozen=True)
class ReadyStack:
    stack: EmbeddedStack
    kafka: KafkaSettings
    database: DatabaseSettings
    started: bool  # this call started it (so its caller may stop it)


def ready_stack(home: Path | None = None, topic_prefix: str | None = None) -> ReadyStack:
    stack = EmbeddedStack(load(StackSettings, home=home))
    was_running = stack.running() is not None
    state = stack.up()
    kafka = load(
        KafkaSettings, bootstrap_servers=state.bootstrap_servers, topic_prefix=topic_prefix
    )
    database = load(DatabaseSettings, database_url=state.database_url)
    asyncio.run(apply_topics(kafka))
    asyncio.run(migrate(database))
    return ReadyStack(stack, kafka, database, not was_running)
