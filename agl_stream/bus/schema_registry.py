"""The Avro schemas under schemas/: the current set and every released set, by fingerprint.

schemas/<Event>.avsc is the source of truth for each event; shared named types live beside
them as <namespace>.<Name>.avsc. schemas/released/<version>/ holds each released set fully
expanded, so bytes written by any release stay readable.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache, cached_property
from importlib import resources
from pathlib import Path
from typing import Any

from fastavro.schema import fingerprint, load_schema, parse_schema, to_parsing_canonical_form

CURRENT = "current"
NAMESPACE = "ai.aglstream"


@dataclass(frozen=True)
class SchemaVersion:
    """One event schema as released (or as it stands now)."""

    event_type: str
    release: str
    schema: Mapping[str, Any]  # fully expanded JSON, docs included
    canonical: str  # Avro Parsing Canonical Form
    fingerprint: bytes  # CRC-64-AVRO of the canonical form, little-endian (as on the wire)
    parsed: Any = field(repr=False, compare=False)

    @cached_property
    def plain(self) -> Any:
        """The schema parsed without logical types (uuid as text, timestamps as integers),
        for readers that convert values themselves (the projector's span rows); parsed on
        first use, so other processes never pay for it."""
        return parse_schema(_without_logical_types(self.schema))

    @property
    def fingerprint_hex(self) -> str:
        return self.fingerprint.hex()


def schemas_dir() -> Path:
    """The directory holding the .avsc files (the repository's schemas/ when editable)."""
    root = resources.files("agl_stream.schemas")
    return Path(str(root))


def _version(event_type: str, release: str, expanded: Mapping[str, Any]) -> SchemaVersion:
    canonical = to_parsing_canonical_form(dict(expanded))
    return SchemaVersion(
        event_type=event_type,
        release=release,
        schema=expanded,
        canonical=canonical,
        fingerprint=bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO")),
        # Parsed once, with fastavro's "already parsed" hint: without it fastavro parses the
        # schema again on every read and write (half the decode time of a span).
        parsed=parse_schema(dict(expanded)),
    )


def _without_logical_types(schema: Any) -> Any:
    if isinstance(schema, Mapping):
        return {k: _without_logical_types(v) for k, v in schema.items() if k != "logicalType"}
    if isinstance(schema, list):
        return [_without_logical_types(v) for v in schema]
    return schema


def load_current(directory: Path | None = None) -> dict[str, SchemaVersion]:
    """Every event schema in schemas/, named references resolved."""
    directory = directory or schemas_dir()
    out: dict[str, SchemaVersion] = {}
    for path in sorted(directory.glob("*.avsc")):
        if path.stem.startswith(NAMESPACE + "."):
            continue  # a shared named type, pulled in by the events that use it
        expanded = load_schema(str(path), _write_hint=False)
        assert isinstance(expanded, dict), f"{path}: an event schema must be a record"
        out[path.stem] = _version(path.stem, CURRENT, expanded)
    return out


def load_released(directory: Path | None = None) -> dict[str, dict[str, SchemaVersion]]:
    """release -> event type -> schema, for every released set."""
    directory = (directory or schemas_dir()) / "released"
    out: dict[str, dict[str, SchemaVersion]] = {}
    if not directory.is_dir():
        return out
    for release_dir in sorted(p for p in directory.iterdir() if p.is_dir()):
        out[release_dir.name] = {
            path.stem: _version(path.stem, release_dir.name, json.loads(path.read_text()))
            for path in sorted(release_dir.glob("*.avsc"))
        }
    return out


def release_key(release: str) -> tuple[int, ...]:
    """Sort releases by version number: 0.10.0 after 0.9.0."""
    return tuple(int(p) if p.isdigit() else -1 for p in release.split("."))


def write_release(release: str, schemas: Iterable[SchemaVersion], directory: Path) -> Path:
    """Freeze a schema set as a release: one fully expanded .avsc per event."""
    target = directory / "released" / release
    if target.exists():
        raise FileExistsError(
            f"release {release} already exists at {target}; releases are immutable"
        )
    target.mkdir(parents=True)
    for version in schemas:
        path = target / f"{version.event_type}.avsc"
        path.write_text(json.dumps(version.schema, indent=2, sort_keys=False) + "\n")
    return target


@dataclass(frozen=True)
class SchemaRegistry:
    current: Mapping[str, SchemaVersion]
    released: Mapping[str, Mapping[str, SchemaVersion]]

    @property
    def by_fingerprint(self) -> dict[bytes, SchemaVersion]:
        table: dict[bytes, SchemaVersion] = {}
        for release in sorted(self.released, key=release_key):
            for version in self.released[release].values():
                table[version.fingerprint] = version
        for version in self.current.values():
            table[version.fingerprint] = version
        return table

    def latest_release(self) -> str | None:
        return max(self.released, key=release_key) if self.released else None


@cache
def default_registry() -> SchemaRegistry:
    return SchemaRegistry(current=load_current(), released=load_released())


def fingerprint_of(schema_text: str) -> bytes:
    """The CRC-64-AVRO fingerprint (as on the wire) of a schema given as JSON text, such as
    a schema registry returns; ValueError when it is no Avro schema."""
    try:
        canonical = to_parsing_canonical_form(json.loads(schema_text))
    except Exception as exc:
        raise ValueError(f"not an Avro schema: {type(exc).__name__}: {exc}") from exc
    return bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))


def record_name(version: SchemaVersion) -> str:
    """The full name of the event's Avro record (ai.aglstream.RolloutQueued)."""
    name = str(version.schema["name"])  # fully expanded schemas name it in full already
    return name if "." in name else f"{version.schema.get('namespace') or NAMESPACE}.{name}"
