"""One export: the source's attempts through the records of a kind into a writer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from agl_stream.export import records
from agl_stream.export.records import AttemptCalls
from agl_stream.export.writers import Writer


@dataclass
class ExportCounts:
    attempts: int = 0
    calls: int = 0
    rows: int = 0


async def export(kind: str, source: AsyncIterator[AttemptCalls], writer: Writer) -> ExportCounts:
    """Write every record of `kind` (transcripts, triplets or pairs) as it is made."""
    counts = ExportCounts()

    async def counted() -> AsyncIterator[AttemptCalls]:
        async for attempt in source:
            counts.attempts += 1
            counts.calls += len(attempt.calls)
            yield attempt

    try:
        await _write(kind, counted(), writer)
    finally:
        writer.close()
    counts.rows = writer.rows
    return counts


async def _write(kind: str, source: AsyncIterator[AttemptCalls], writer: Writer) -> None:
    out: Any
    if kind == "pairs":
        group: list[AttemptCalls] = []
        async for attempt in source:
            if group and attempt.group != group[0].group:
                for out in records.pairs(group):
                    writer.write(out)
                group = []
            group.append(attempt)
        for out in records.pairs(group):
            writer.write(out)
    else:
        async for attempt in source:
            if kind == "transcripts":
                writer.write(records.transcript(attempt))
            else:
                for out in records.triplets(attempt):
                    writer.write(out)
