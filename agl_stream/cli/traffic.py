"""Learning from production traffic: `agl-stream reward` (late and external rewards),
`agl-stream ingest otlp` (spans from other systems) and `agl-stream export` (datasets)."""

from __future__ import annotations

import math
from datetime import datetime

import click

from agl_stream.cli.common import AppContext, console, friendly_errors, parse_key_values, run
from agl_stream.cli.times import TIME
from agl_stream.events import DEFAULT_REWARD_NAME


def _finite(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a number", param_hint="VALUE") from None
    if not math.isfinite(number):
        raise click.BadParameter(f"{value!r} is not a finite number", param_hint="VALUE")
    return number


@click.command("reward", context_settings={"ignore_unknown_options": True})
@click.argument("rollout_id")
@click.argument("value")
@click.option("--name", default=DEFAULT_REWARD_NAME, show_default=True, help="Which reward.")
@click.option("--attempt", "attempt_id", help="The attempt it is for (default: the rollout).")
@click.option("--call", "span_id", metavar="SPAN_ID", help="The LLM call span it is for.")
@click.option("--source", default="cli", show_default=True, help="Who gives it.")
@click.option("--metadata", multiple=True, metavar="KEY=VALUE", help="Repeatable.")
@click.option("--given-at", type=TIME, help="When it was given (default: now).")
@click.pass_obj
@friendly_errors
def reward_command(
    app: AppContext,
    /,
    rollout_id: str,
    value: str,
    name: str,
    attempt_id: str | None,
    span_id: str | None,
    source: str,
    metadata: tuple[str, ...],
    given_at: datetime | None,
) -> None:
    """Give ROLLOUT_ID a reward of VALUE, now or long after it ran (feedback, a label, a CI
    result). It counts once an attempt of the rollout is on the rollouts topic: a reward for
    an unknown rollout or attempt goes to the dead-letter topic with the reason
    (`agl-stream dlq list`). `agl-stream query rewards ROLLOUT_ID` shows those that counted."""
    from agl_stream.late_rewards import BadReward, RewardSender, make_reward

    try:
        event = make_reward(
            rollout_id, _finite(value), name=name, attempt_id=attempt_id, span_id=span_id,
            source=source, metadata=parse_key_values(metadata, "--metadata"), given_at=given_at,
        )  # fmt: skip
    except BadReward as exc:
        raise click.UsageError(str(exc)) from None

    async def send() -> None:
        async with RewardSender(app.kafka()) as sender:
            landed = await sender.send_event(event)
        console.print(
            f"reward {event.name}={event.value:g} for {rollout_id} recorded "
            f"({landed.topic}[{landed.partition}]@{landed.offset}, event {event.event_id})",
            highlight=False,
        )

    run(send())
