"""`agl-stream schemas ...`: the event contracts, for people and for other languages."""

from __future__ import annotations

import json

import click
from rich.table import Table

from agl_stream.bus.codec import schema_ids
from agl_stream.bus.registry_client import COMPATIBILITY
from agl_stream.bus.schema_compat import compatibility_errors
from agl_stream.bus.schema_registry import default_registry, schemas_dir, write_release
from agl_stream.cli.common import console, friendly_errors
from agl_stream.runtime.config import WireSettings, load
from agl_stream.runtime.version import __version__


@click.group()
def schemas() -> None:
    """Avro schemas of the events (schemas/*.avsc) and their compatibility."""


@schemas.command("list")
@friendly_errors
def list_schemas() -> None:
    """List the event schemas with their single-object fingerprints."""
    registry = default_registry()
    table = Table(title="event schemas", title_justify="left")
    for column in ("event", "fingerprint (wire bytes 2-9)", "fields"):
        table.add_column(column)
    for name, version in sorted(registry.current.items()):
        table.add_row(name, version.fingerprint_hex, str(len(version.schema["fields"])))
    console.print(table)


@schemas.command("show")
@click.argument("event_type")
@click.option("--canonical", is_flag=True, help="Print the Parsing Canonical Form instead.")
@friendly_errors
def show(event_type: str, canonical: bool) -> None:
    """Print one event's schema, fully expanded (what another language's Avro library needs)."""
    current = default_registry().current
    if event_type not in current:
        raise click.BadParameter(
            f"no event {event_type!r}; events: {sorted(current)}", param_hint="EVENT_TYPE"
        )
    version = current[event_type]
    click.echo(version.canonical if canonical else json.dumps(version.schema, indent=2))


@schemas.command("register")
@click.option(
    "--registry-url",
    help="The registry's Confluent API. [default: AGL_STREAM_SCHEMA_REGISTRY_URL]",
)
@friendly_errors
def register(registry_url: str | None) -> None:
    """Register every released schema set, then the current one, with a schema registry,
    each subject (<topic>-<record name>) held to the compatibility `schemas check` enforces."""
    url = load(WireSettings, schema_registry_url=registry_url).schema_registry_url
    if url is None:
        raise click.UsageError("give --registry-url or set AGL_STREAM_SCHEMA_REGISTRY_URL")
    done = schema_ids(url).register_all()
    table = Table(title=f"registered at {url} ({COMPATIBILITY})", title_justify="left")
    for column in ("subject", "release", "id"):
        table.add_column(column)
    for subject, release, schema_id in done:
        table.add_row(subject, release, str(schema_id))
    console.print(table)


@schemas.command("check")
@friendly_errors
def check() -> None:
    """Check that the schemas stay compatible, both ways, with every released set."""
    registry = default_registry()
    current = {k: v.schema for k, v in registry.current.items()}
    failures = 0
    for release, released in sorted(registry.released.items()):
        errors = compatibility_errors({k: v.schema for k, v in released.items()}, current)
        failures += len(errors)
        for error in errors:
            console.print(f"[red]{release}[/]: {error}", highlight=False)
        if not errors:
            console.print(f"compatible with release {release}")
    if failures:
        raise SystemExit(1)


@schemas.command("release")
@click.option("--version", "release", default=__version__, show_default=True)
@friendly_errors
def release(release: str) -> None:
    """Freeze the current schemas as a release under schemas/released/ (releases are immutable)."""
    path = write_release(release, default_registry().current.values(), schemas_dir())
    console.print(f"wrote {path}")
