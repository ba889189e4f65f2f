"""What every benchmark starts with: the embedded stack (started if it is not running) and a
fresh set of topics of its own, so runs never read each other's records."""

from __future__ import annotations

from agl_stream.config import KafkaSettings, StackSettings, load
from agl_stream.embedded.stack import EmbeddedStack, StackState
from agl_stream.topic_admin import apply_topics


async def fresh_topics(prefix: str) -> tuple[StackState, KafkaSettings]:
    """The running stack and Kafka settings for topics named `<prefix>.*`, created."""
    stack = EmbeddedStack(load(StackSettings))
    state = stack.running() or stack.up()
    kafka = load(
        KafkaSettings, bootstrap_servers=state.bootstrap_servers, topic_prefix=f"{prefix}."
    )
    await apply_topics(kafka)
    return state, kafka
