"""Writing records as they come: JSON Lines, or Parquet in row groups of `batch_rows` (a
fixed schema per kind, so every row group agrees). Memory: one row group at most."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Protocol

import orjson


class Writer(Protocol):
    rows: int

    def write(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlWriter:
    def __init__(self, out: IO[bytes]) -> None:
        self.out = out
        self.rows = 0

    def write(self, record: Mapping[str, Any]) -> None:
        self.out.write(orjson.dumps(record) + b"\n")
        self.rows += 1

    def close(self) -> None:
        self.out.flush()


def _schemas() -> dict[str, Any]:
    import pyarrow as pa

    message = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    common = [
        ("rollout_id", pa.string()), ("attempt_id", pa.string()), ("mode", pa.string()),
        ("metadata", pa.map_(pa.string(), pa.string())), ("finished_at", pa.string()),
        ("reward", pa.float64()),
    ]  # fmt: skip
    return {
        "transcripts": pa.schema([("messages", message), *common]),
        "triplets": pa.schema([
            *common, ("call_index", pa.int32()), ("prompt_messages", message),
            ("prompt_text", pa.string()), ("completion", pa.string()),
            ("prompt_token_ids", pa.list_(pa.int64())),
            ("response_token_ids", pa.list_(pa.int64())),
            ("response_logprobs", pa.list_(pa.float64())),
        ]),
        "pairs": pa.schema([
            ("prompt", message), ("chosen", message), ("rejected", message),
            ("chosen_reward", pa.float64()), ("rejected_reward", pa.float64()),
            ("chosen_rollout_id", pa.string()), ("rejected_rollout_id", pa.string()),
            ("group", pa.string()),
        ]),
    }  # fmt: skip


class ParquetWriter:
    def __init__(self, path: Path, kind: str, batch_rows: int = 2000) -> None:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise RuntimeError("Parquet needs pyarrow: pip install 'agl-stream[parquet]'") from None
        self.schema = _schemas()[kind]
        self.batch_rows = batch_rows
        self._writer = pq.ParquetWriter(str(path), self.schema, compression="zstd")
        self._pending: list[dict[str, Any]] = []
        self.rows = 0

    def write(self, record: Mapping[str, Any]) -> None:
        row = dict(record)
        if "metadata" in row:
            row["metadata"] = list((row["metadata"] or {}).items())
        self._pending.append(row)
        self.rows += 1
        if len(self._pending) >= self.batch_rows:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self._pending:
            self._writer.write_table(pa.Table.from_pylist(self._pending, schema=self.schema))
            self._pending = []

    def close(self) -> None:
        self._flush()
        self._writer.close()
