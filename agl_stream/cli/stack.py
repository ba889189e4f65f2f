"""`agl-stream up` and `agl-stream down`."""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from agl_stream.bus.codec import schema_ids
from agl_stream.bus.topic_admin import apply_topics
from agl_stream.cli.common import AppContext, PathType, console, friendly_errors, run
from agl_stream.db.migrate import migrate
from agl_stream.embedded.stack import EmbeddedStack
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings, StackSettings, load


def _stack(
    home: Path | None,
    broker_port: int | None,
    postgres_port: int | None,
    kafka_nodes: int | None = None,
    registry: bool | None = None,
    registry_port: int | None = None,
) -> EmbeddedStack:
    settings = load(
        StackSettings,
        home=home,
        broker_port=broker_port,
        postgres_port=postgres_port,
        kafka_nodes=kafka_nodes,
        registry=registry,
        registry_port=registry_port,
    )
    return EmbeddedStack(settings)


home_option = click.option(
    "--home",
    type=PathType(file_okay=False, path_type=Path),
    help="State directory of the stack. [env: AGL_STREAM_HOME; default: ./.agl-stream]",
)


@click.command()
@home_option
@click.option("--broker-port", type=int, help="[env: AGL_STREAM_BROKER_PORT; default: 19092]")
@click.option("--postgres-port", type=int, help="[env: AGL_STREAM_POSTGRES_PORT; default: 15432]")
@click.option(
    "--kafka-nodes",
    type=int,
    help="Kafka nodes on loopback, each broker and controller "
    "[env: AGL_STREAM_KAFKA_NODES; default: 1]",
)
@click.option(
    "--registry/--no-registry",
    default=None,
    help="Also run a schema registry (Apicurio; for AGL_STREAM_WIRE=confluent; built with "
    "Maven on first use). [env: AGL_STREAM_REGISTRY; default: no]",
)
@click.option("--registry-port", type=int, help="[env: AGL_STREAM_REGISTRY_PORT; default: 18081]")
@click.pass_obj
@friendly_errors
def up(
    app: AppContext,
    home: Path | None,
    broker_port: int | None,
    postgres_port: int | None,
    kafka_nodes: int | None,
    registry: bool | None,
    registry_port: int | None,
) -> None:
    """Start the embedded stack: Apache Kafka (KRaft) and PostgreSQL on this machine.

    Creates the topics and the database schema, and prints the connection settings. Data is
    kept in the home directory: `down` then `up` finds it again. Running it twice is harmless.
    """
    stack = _stack(home, broker_port, postgres_port, kafka_nodes, registry, registry_port)
    with console.status("starting Apache Kafka and PostgreSQL..."):
        state = stack.up()
    kafka = load(
        KafkaSettings, bootstrap_servers=state.bootstrap_servers, topic_prefix=app.topic_prefix
    )
    database = load(DatabaseSettings, database_url=state.database_url)
    with console.status("applying topics and the database schema..."):
        report = run(apply_topics(kafka))
        revision = run(migrate(database))
    if state.registry_url is not None:
        with console.status("registering the event schemas with the schema registry..."):
            registered = schema_ids(state.registry_url, kafka).register_all()
    table = Table(title="agl-stream embedded stack is up", show_header=False, title_justify="left")
    table.add_row(
        "broker", f"{state.broker} ({len(state.nodes)} node(s)), {state.bootstrap_servers}"
    )
    table.add_row("database", database.display_url())
    table.add_row("topics", f"{len(report.created)} created, {len(report.in_sync)} already there")
    table.add_row("schema revision", str(revision))
    if state.registry_url is not None:
        subjects = len({name for name, _, _ in registered})
        table.add_row("schema registry", f"{state.registry_url} ({subjects} subjects)")
    table.add_row("home", state.home)
    console.print(table)
    console.print("Connect other shells with:", style="bold")
    for key, value in state.environment().items():
        console.print(f"  export {key}={value}", highlight=False, soft_wrap=True)
    console.print(f"(or `source {Path(state.home) / 'env'}`)", highlight=False)


@click.command()
@home_option
@friendly_errors
def down(home: Path | None) -> None:
    """Stop the embedded stack. Its data stays for the next `agl-stream up`."""
    stack = _stack(home, None, None)
    with console.status("stopping..."):
        stopped = stack.down()
    console.print("stopped" if stopped else f"nothing was running under {stack.home}")
