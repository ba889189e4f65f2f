"""The Confluent schema-registry API, as far as agl-stream uses it, and the cache of schema
ids that keeps a busy consumer from asking the registry about every record.

The client is synchronous (urllib): the codec decodes inside synchronous code everywhere, and
it asks the registry only about an id it has not seen (once per id and process; an id the
registry does not know is asked about again after NEGATIVE_SECONDS at the earliest).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agl_stream.bus.schema_registry import (
    SchemaRegistry,
    SchemaVersion,
    fingerprint_of,
    record_name,
    release_key,
)
from agl_stream.bus.wire import subject

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
# `agl-stream schemas check` holds every schema compatible both ways with every released set.
COMPATIBILITY = "FULL_TRANSITIVE"
NEGATIVE_SECONDS = 30.0


class RegistryError(RuntimeError):
    """The registry could not be reached, or refused a request; the message says which."""


class RegistryClient:
    """The Confluent REST API at `url` (Apicurio: http://host:port/apis/ccompat/v7)."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self._timeout = timeout

    def register(self, subject_name: str, schema: Mapping[str, Any]) -> int:
        """The id of `schema` under the subject, registering it when new (idempotent)."""
        body = {"schema": json.dumps(schema, separators=(",", ":"))}
        answer = self._call("POST", f"/subjects/{subject_name}/versions", body)
        return int(answer["id"])

    def schema_text(self, schema_id: int) -> str | None:
        """The schema registered with `schema_id` as JSON text; None when the registry does
        not know the id."""
        answer = self._call("GET", f"/schemas/ids/{schema_id}", missing_ok=True)
        return None if answer is None else str(answer["schema"])

    def set_compatibility(self, subject_name: str, level: str) -> None:
        self._call("PUT", f"/config/{subject_name}", {"compatibility": level})

    def compatibility(self, subject_name: str) -> str | None:
        answer = self._call("GET", f"/config/{subject_name}", missing_ok=True)
        return None if answer is None else str(answer.get("compatibilityLevel"))

    def _call(self, method: str, path: str, body: object = None, missing_ok: bool = False) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Content-Type": CONTENT_TYPE, "Accept": CONTENT_TYPE},
        )
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            if exc.code == 404 and missing_ok:
                return None
            detail = exc.read().decode(errors="replace").strip()
            raise RegistryError(
                f"the schema registry at {self.url} refused {method} {path} "
                f"(HTTP {exc.code}): {detail[:300]}"
            ) from None
        except (OSError, ValueError) as exc:
            raise RegistryError(
                f"the schema registry at {self.url} did not answer {method} {path} "
                f"({type(exc).__name__}: {exc}); check AGL_STREAM_SCHEMA_REGISTRY_URL"
            ) from None


@dataclass(frozen=True)
class UnknownId:
    """Why a schema id cannot be decoded; `reason` fits a dead-letter header."""

    reason: str


class SchemaIds:
    """Registry ids <-> agl-stream's schemas, cached. A consumer asks the registry once per id
    it meets; a producer registers the current schemas once (`writer_id`)."""

    def __init__(
        self,
        client: RegistryClient,
        schemas: SchemaRegistry,
        topic_of: Mapping[str, str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self._schemas = schemas
        self._by_fingerprint = schemas.by_fingerprint
        self._topic_of = dict(topic_of)  # event type -> full topic name
        self._clock = clock
        self._known: dict[int, SchemaVersion] = {}
        self._unknown: dict[int, tuple[float, UnknownId]] = {}
        self._writer_ids: dict[str, int] = {}
        self._lock = threading.Lock()

    def writer_id(self, event_type: str) -> int:
        """The id of the current schema of `event_type` (registered on first use)."""
        found = self._writer_ids.get(event_type)
        if found is not None:
            return found
        version = self._schemas.current[event_type]
        schema_id = self.client.register(self.subject_of(version), version.schema)
        with self._lock:
            self._writer_ids[event_type] = schema_id
            self._known[schema_id] = version
        return schema_id

    def writer_of(self, schema_id: int) -> SchemaVersion | UnknownId:
        """The schema records with this id were written with, or why there is none."""
        version = self._known.get(schema_id)
        if version is not None:
            return version
        refused = self._unknown.get(schema_id)
        if refused is not None and self._clock() - refused[0] < NEGATIVE_SECONDS:
            return refused[1]
        text = self.client.schema_text(schema_id)
        found: SchemaVersion | UnknownId
        if text is None:
            found = UnknownId(
                f"unknown schema id {schema_id}: the schema registry at {self.client.url} "
                "does not know it"
            )
        else:
            try:
                version = self._by_fingerprint.get(fingerprint_of(text))
            except ValueError as exc:
                version, text = None, f"({exc})"
            found = version or UnknownId(
                f"schema id {schema_id} is not one of agl-stream's current or released event "
                f"schemas: {text[:200]}"
            )
        with self._lock:
            if isinstance(found, UnknownId):
                self._unknown[schema_id] = (self._clock(), found)
            else:
                self._known[schema_id] = found
        return found

    def subject_of(self, version: SchemaVersion) -> str:
        topic = self._topic_of.get(version.event_type)
        if topic is None:
            raise RegistryError(f"no topic under topics/ carries {version.event_type} events")
        return subject(topic, record_name(version))

    def register_all(self) -> list[tuple[str, str, int]]:
        """Register every released schema set (oldest first), then the current one, each
        subject held to COMPATIBILITY; (subject, release, id) for each schema."""
        sets: list[Iterable[SchemaVersion]] = [
            self._schemas.released[r].values()
            for r in sorted(self._schemas.released, key=release_key)
        ]
        sets.append(self._schemas.current.values())
        done: list[tuple[str, str, int]] = []
        configured: set[str] = set()
        for versions in sets:
            for version in sorted(versions, key=lambda v: v.event_type):
                if version.event_type not in self._topic_of:
                    continue  # an event type no topic carries any more
                name = self.subject_of(version)
                schema_id = self.client.register(name, version.schema)
                if name not in configured:
                    # After the subject's first version (nothing to compare it with yet):
                    # some registries (Apicurio) keep no config for a subject without one.
                    self.client.set_compatibility(name, COMPATIBILITY)
                    configured.add(name)
                with self._lock:
                    self._known[schema_id] = version
                done.append((name, version.release, schema_id))
        return done
