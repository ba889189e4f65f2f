"""`agl-stream`: one CLI for the embedded stack, topics, schemas and status."""

from __future__ import annotations

import click

from agl_stream.cli import (
    cancel,
    dashboard,
    db,
    demo,
    dlq,
    enqueue,
    query,
    replay,
    requeue,
    resources,
    schemas,
    serving,
    stack,
    status,
    store,
    topics,
    traffic,
    train,
    worker,
)
from agl_stream.cli.common import AppContext
from agl_stream.runtime.config import ConfigError, WireSettings, load
from agl_stream.runtime.version import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="agl-stream")
@click.option(
    "--bootstrap-servers",
    metavar="HOST:PORT,...",
    help="Kafka brokers. [env: AGL_STREAM_BOOTSTRAP_SERVERS; default: the embedded broker]",
)
@click.option(
    "--topic-prefix",
    metavar="PREFIX",
    help="Prefix of topic names. [env: AGL_STREAM_TOPIC_PREFIX; default: agl.]",
)
@click.option(
    "--database-url",
    metavar="URL",
    help="PostgreSQL URL. [env: AGL_STREAM_DATABASE_URL; default: the embedded database]",
)
@click.pass_context
def cli(
    ctx: click.Context,
    bootstrap_servers: str | None,
    topic_prefix: str | None,
    database_url: str | None,
) -> None:
    """agl-stream trains AI agents over an event-sourced Kafka pipeline.

    Start here: `agl-stream up` runs a broker and PostgreSQL on this machine; `agl-stream
    status` shows what is there.
    """
    try:
        load(WireSettings)  # a bad wire stops every command at once, naming the setting
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    ctx.obj = AppContext(bootstrap_servers, topic_prefix, database_url)


cli.add_command(demo.demo)
cli.add_command(dashboard.dashboard)
cli.add_command(serving.serve)
cli.add_command(serving.gateway)
cli.add_command(stack.up)
cli.add_command(stack.down)
cli.add_command(status.status)
cli.add_command(topics.topics)
cli.add_command(schemas.schemas)
cli.add_command(dlq.dlq)
cli.add_command(db.db)
cli.add_command(enqueue.enqueue_command)
cli.add_command(cancel.cancel_command)
cli.add_command(requeue.requeue_command)
cli.add_command(worker.worker)
cli.add_command(store.store)
cli.add_command(query.query)
cli.add_command(resources.resources)
cli.add_command(replay.replay_command)
cli.add_command(train.retrain_command)
cli.add_command(train.checkpoints_command)
cli.add_command(traffic.reward_command)
cli.add_command(traffic.ingest)
cli.add_command(traffic.export_command)


if __name__ == "__main__":
    cli()
