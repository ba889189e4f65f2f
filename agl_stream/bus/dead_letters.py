"""Dead letters: records that could not become events, kept with the reason and their origin.

A dead letter keeps the original key, value and headers, and adds agl.dlq.* headers. Its key
on the dead-letter topic is "<topic>:<partition>:<offset>", so repeats (at-least-once
delivery, several consumer groups) are recognisable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

REASON = "agl.dlq.reason"
KIND = "agl.dlq.kind"
SOURCE_TOPIC = "agl.dlq.source.topic"
SOURCE_PARTITION = "agl.dlq.source.partition"
SOURCE_OFFSET = "agl.dlq.source.offset"
SOURCE_TIMESTAMP = "agl.dlq.source.timestamp"
CONSUMER = "agl.dlq.consumer"
AT = "agl.dlq.at"

Headers = Sequence[tuple[str, bytes]]


@dataclass(frozen=True)
class DeadLetter:
    key: bytes
    value: bytes | None
    headers: list[tuple[str, bytes]]


def dead_letter(
    *,
    topic: str,
    partition: int,
    offset: int,
    timestamp_ms: int | None,
    value: bytes | None,
    headers: Headers,
    reason: str,
    kind: str,
    consumer: str,
    now: datetime | None = None,
) -> DeadLetter:
    """Build the dead letter for one bad record (pure)."""
    at = (now or datetime.now(UTC)).isoformat()
    ours = [
        (REASON, reason.encode()),
        (KIND, kind.encode()),
        (SOURCE_TOPIC, topic.encode()),
        (SOURCE_PARTITION, str(partition).encode()),
        (SOURCE_OFFSET, str(offset).encode()),
        (CONSUMER, consumer.encode()),
        (AT, at.encode()),
    ]
    if timestamp_ms is not None:
        ours.append((SOURCE_TIMESTAMP, str(timestamp_ms).encode()))
    kept = [(k, v) for k, v in headers if not k.startswith("agl.dlq.")]
    return DeadLetter(f"{topic}:{partition}:{offset}".encode(), value, kept + ours)


@dataclass(frozen=True)
class DeadLetterView:
    """A dead letter as read back from the topic."""

    source_topic: str
    source_partition: int
    source_offset: int
    reason: str
    kind: str
    consumer: str
    at: str
    value: bytes | None
    dlq_offset: int

    @classmethod
    def parse(cls, headers: Headers, value: bytes | None, dlq_offset: int) -> DeadLetterView:
        """Whatever is on the dead-letter topic, also a record something else put there: a
        missing or unreadable header reads as "?" (or -1 for a number)."""
        h = {k: (v or b"").decode(errors="replace") for k, v in headers}
        return cls(
            source_topic=h.get(SOURCE_TOPIC, "?"),
            source_partition=_number(h.get(SOURCE_PARTITION)),
            source_offset=_number(h.get(SOURCE_OFFSET)),
            reason=h.get(REASON, "?"),
            kind=h.get(KIND, "?"),
            consumer=h.get(CONSUMER, "?"),
            at=h.get(AT, "?"),
            value=value,
            dlq_offset=dlq_offset,
        )


def _number(text: str | None) -> int:
    try:
        return int(text) if text is not None else -1
    except ValueError:
        return -1
