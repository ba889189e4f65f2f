"""Stopping rollouts: a RolloutCancelled on the tasks topic for each, and choosing which
from the read model (by id, to catch ids never queued, or by filter)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pydantic import ValidationError

from agl_stream.bus.kafka import producer
from agl_stream.bus.streams import EventPublisher, Topics
from agl_stream.events import RolloutCancelled
from agl_stream.queries import ReadModel, Rollout
from agl_stream.queries.params import MAX_LIMIT, RolloutFilter
from agl_stream.runtime.config import KafkaSettings

# The read model's statuses of a rollout that has not finished: what a cancel can still stop.
OPEN_STATUSES = ("queuing", "requeuing", "running")


class CancelError(ValueError):
    """A cancellation that cannot be asked for; the message says why."""


async def cancel(
    kafka: KafkaSettings,
    rollout_ids: Iterable[str],
    reason: str | None = None,
    requested_by: str | None = None,
) -> list[str]:
    """Ask the runners to stop these rollouts; returns the ids (each once, a single string
    taken as one id) once the broker has every request.

    A rollout not started yet finishes `cancelled` without running; a running attempt is
    stopped and the rollout finishes `cancelled`, with `reason` and `requested_by` in the
    error; a finished rollout stays as it ended (a runner with every slot busy reads the
    request too: see runner/cancel_watch.py). The ids are not looked up: a cancel
    for an id never queued is kept by the read model as a rollout that is queuing (see
    select_by_id to check ids first)."""
    ids = list(dict.fromkeys([rollout_ids] if isinstance(rollout_ids, str) else rollout_ids))
    try:
        events = [
            RolloutCancelled(rollout_id=i, reason=reason, requested_by=requested_by) for i in ids
        ]
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise CancelError(f"invalid cancellation: {problems}") from None
    if events:
        async with producer(kafka, linger_ms=5) as prod:
            await EventPublisher(prod, Topics(kafka)).publish_many("tasks", events)
    return ids


@dataclass(frozen=True)
class Selection:
    """Rollout ids looked up in the read model."""

    open: list[Rollout]  # not finished: what a cancel stops
    finished: list[Rollout]  # succeeded, failed or cancelled already: a cancel changes nothing
    unknown: list[str]  # not in the read model: never queued, or not projected yet


async def select_by_id(rm: ReadModel, rollout_ids: Iterable[str]) -> Selection:
    """Sort ids into open, finished and unknown, in the order given (each once)."""
    ids = list(dict.fromkeys(rollout_ids))
    found = await rm.rollouts_by_id(ids)
    known = [found[i] for i in ids if i in found]
    return Selection(
        open=[r for r in known if r.status in OPEN_STATUSES],
        finished=[r for r in known if r.status not in OPEN_STATUSES],
        unknown=[i for i in ids if i not in found],
    )


async def select_by_filter(rm: ReadModel, f: RolloutFilter) -> list[Rollout]:
    """Every open rollout the filter matches (all pages, by id; its sort, limit and cursor
    are not used). Without a status it means all open ones; a finished status is refused."""
    finished = [s for s in f.status if s not in OPEN_STATUSES]
    if finished:
        raise CancelError(
            f"a finished rollout cannot be cancelled: status {', '.join(finished)} is not "
            f"one of {', '.join(OPEN_STATUSES)}"
        )
    page_filter = f.model_copy(
        update={"status": f.status or OPEN_STATUSES, "sort": "id", "descending": False,
                "limit": MAX_LIMIT, "cursor": None}
    )  # fmt: skip
    out: list[Rollout] = []
    while True:
        page = await rm.rollouts(page_filter)
        out += page.items
        if page.next_cursor is None:
            return out
        page_filter = page_filter.model_copy(update={"cursor": page.next_cursor})
