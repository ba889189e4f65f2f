"""The runner worker: claims rollouts through the runners' consumer group and runs them.

- Up to `concurrency` attempts at once, several from one partition, so a slow rollout never
  holds up the ones behind it.
- A partition's offset is committed only up to its lowest unfinished record: a runner killed
  at any instant loses nothing; the next owner runs the unfinished records again as new
  attempts.
- Everything a partition's records cause is written through that partition's lane (a
  transactional producer, see lane.py) together with the partition's offset: a new owner
  fences the old one, so a runner cut off from its group cannot publish after the takeover.
- Before it handles any record of a newly assigned partition, the owner fences the previous
  writer and folds the co-partitioned rollouts partition from the offset committed with the
  tasks offset, so what already finished is not run again.
- Cancels are read ahead of the claims by a second consumer (cancel_watch.py) on the
  partitions with a lane, so they reach a runner with every slot busy too (its partitions
  are paused then).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections import Counter, deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import IllegalStateError
from aiokafka.structs import RecordMetadata
from opentelemetry.trace import INVALID_SPAN, Span, Status, StatusCode

from agl_stream.agent.api import LitAgent, Rollout
from agl_stream.agent.tracing import Tracing
from agl_stream.bus.kafka import (
    IDLE_METADATA_AGE_MS,
    admin_client,
    consumer,
    producer,
    reachable,
    retrying,
)
from agl_stream.bus.roles import role
from agl_stream.bus.streams import (
    ConsumedEvent,
    EventPublisher,
    EventStream,
    Topics,
    read_partition_with,
    reusable_reader,
)
from agl_stream.bus.topic_admin import ensure_topics_ready
from agl_stream.commands.resources import ResourceCache, follow_resources
from agl_stream.events import (
    AttemptFinished,
    AttemptStarted,
    AttemptStatus,
    ErrorInfo,
    Event,
    RolloutCancelled,
    RolloutFinished,
    RolloutQueued,
    RolloutStatus,
    WorkerHeartbeat,
    WorkerRole,
    WorkerStatus,
)
from agl_stream.gateway.proxy import Gateway
from agl_stream.runner.attempt import AttemptHandle, Outcome, execute
from agl_stream.runner.cancel_watch import CancelWatch
from agl_stream.runner.lane import Checkpoint, Lane, LaneClosed, committed_checkpoint
from agl_stream.runner.ledger import Action, Ledger, cancelled_error
from agl_stream.runner.offsets import PartitionProgress
from agl_stream.runner.policy import Requeue, decide
from agl_stream.runtime.config import KafkaSettings
from agl_stream.runtime.redaction import Redaction
from agl_stream.runtime.supervision import Supervisor, restarting
from agl_stream.telemetry.metrics import WorkerMetrics
from agl_stream.telemetry.spans import fail

log = logging.getLogger(__name__)
T = TypeVar("T")


def runner_group(topic_prefix: str) -> str:
    """The runners' consumer group (workers/runner.toml): one per topic prefix (agl. ->
    agl-runners), so separate deployments on one cluster never share a group."""
    return role("runner").group_id(topic_prefix)


HAND_BACK_GRACE_SECONDS = 2.0
RUNNER_TOPICS = ("tasks", "rollouts", "spans", "resources", "workers", "dlq")


@dataclass
class RunnerConfig:
    agent: LitAgent
    concurrency: int = 16
    group_id: str | None = None  # default: runner_group(topic prefix)
    worker_id: str = field(default_factory=lambda: f"runner-{socket.gethostname()}-{os.getpid()}")
    heartbeat_seconds: float = 5.0
    shutdown_grace_seconds: float = 30.0
    session_timeout_ms: int = 10_000
    commit_seconds: float = 0.5
    # How long an attempt waits for a pinned resources version the runner has not seen yet.
    pin_wait_seconds: float = 10.0
    # Batching: a short linger collects the spans and lifecycle events of many concurrent
    # attempts into one produce request.
    linger_ms: int = 10
    # How often each partition's lane commits a transaction (events and offset together).
    transaction_seconds: float = 0.05
    # The LLM gateway in this process: agents' LLM resources point at it (per-attempt URLs),
    # it records every call into the attempt. Port 0: any free port.
    gateway: bool = True
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 0
    # Bearer tokens of the gateway: what calls off an attempt's URL must carry, and what it
    # sends to the upstreams (agl_stream/runtime/auth.py).
    gateway_token: str | None = None
    upstream_token: str | None = None
    # Applied to every span before it leaves this process (agl_stream/runtime/redaction.py).
    redaction: Redaction = field(default_factory=Redaction.of)


@dataclass(frozen=True)
class Takeover:
    """One partition taken over: how many rollouts records its fold read, and how long
    settling it took (fencing, the checkpoint, the fold)."""

    tp: TopicPartition
    records_read: int
    seconds: float


@dataclass(frozen=True)
class Claim:
    """A task record being worked on: where it is."""

    tp: TopicPartition
    offset: int


@dataclass
class InFlight:
    tp: TopicPartition
    offset: int
    task: RolloutQueued
    job: asyncio.Task[None]
    handle: AttemptHandle = field(default_factory=AttemptHandle)
    attempt_id: str | None = None  # once its AttemptStarted is in the lane
    span: Span = INVALID_SPAN  # the record's handling, from its claim to its end committed


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self.runner.hand_back(set(revoked))

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        await self.runner.take_over(set(assigned))


class Runner:
    def __init__(self, kafka: KafkaSettings, config: RunnerConfig) -> None:
        self.kafka = kafka
        self.config = config
        self.topics = Topics(kafka)
        # Per tasks partition, from the fold at takeover on; pruned as the commit passes.
        self.ledgers: dict[TopicPartition, Ledger] = {}
        self.resources = ResourceCache()
        self.progress: dict[TopicPartition, PartitionProgress] = {}
        self.in_flight: dict[tuple[str, int], InFlight] = {}
        self.counts: Counter[str] = Counter()
        self.group_id = config.group_id or runner_group(kafka.topic_prefix)
        self._slot_freed = asyncio.Event()
        self._resources_loaded = asyncio.Event()
        self._producer: AIOKafkaProducer | None = None
        self._publisher: EventPublisher | None = None
        self._consumer: AIOKafkaConsumer | None = None
        # What every takeover reads through (the checkpoint, the ends, the fold), kept for
        # the runner's life (see _settle_partition).
        self._admin: AIOKafkaAdminClient | None = None
        self._reader: AIOKafkaConsumer | None = None
        self.lanes: dict[TopicPartition, Lane] = {}
        # The committed offset found when a partition was settled: records below it are
        # done (the consumer may hold some, fetched from an older commit).
        self._floors: dict[TopicPartition, int] = {}
        self.takeovers: deque[Takeover] = deque(maxlen=1000)
        # Bumped by every revocation and assignment: a partition settled under an older
        # assignment gets no lane (the new assignment settles what is ours then).
        self._epoch = 0
        self._rebalancing = False
        self.gateway: Gateway | None = None
        self.background = Supervisor()
        # Kept in step with the lanes: a partition is watched from its settling on.
        self.cancel_watch = CancelWatch(self._cancelled)
        self.metrics = WorkerMetrics("runner", self._counts, self._partition_lag)

    @property
    def publisher(self) -> EventPublisher:
        assert self._publisher is not None, "the runner is not running"
        return self._publisher

    async def run(self, stop: asyncio.Event) -> None:
        """Run until `stop` is set, then finish or hand back in-flight work within the grace."""
        await ensure_topics_ready(self.kafka, RUNNER_TOPICS)
        Tracing.install()
        async with producer(self.kafka, linger_ms=self.config.linger_ms) as prod:
            self._producer = prod
            self._publisher = EventPublisher(prod, self.topics)
            if self.config.gateway:
                self.gateway = Gateway(
                    publisher=self._publisher,
                    token=self.config.gateway_token,
                    upstream_token=self.config.upstream_token,
                    redaction=self.config.redaction,
                )
                await self.gateway.start(self.config.gateway_host, self.config.gateway_port)
            await self._heartbeat(WorkerStatus.STARTING)
            # A follower or heartbeat that fails is logged and started again; one that ends
            # otherwise fails the runner (the loop checks), never leaves it waiting.
            background = self.background
            background.spawn(
                restarting(self._follow_resources, "the resources follower"),
                "the resources follower",
            )
            await background.watch(self._resources_loaded.wait())
            background.spawn(
                restarting(lambda: self._heartbeats(stop), "the heartbeats"),
                "the heartbeats",
                may_return=True,
            )
            background.spawn(
                restarting(lambda: self.cancel_watch.follow(self.kafka), "the cancel watch"),
                "the cancel watch",
            )
            try:
                async with (
                    admin_client(self.kafka, metadata_max_age_ms=IDLE_METADATA_AGE_MS) as admin,
                    reusable_reader(self.kafka) as fold_reader,
                    consumer(
                        self.kafka,
                        group_id=self.group_id,
                        session_timeout_ms=self.config.session_timeout_ms,
                        heartbeat_interval_ms=max(self.config.session_timeout_ms // 5, 500),
                        # The loop polls at least every 0.5 s (pausing partitions when full),
                        # so a short rebalance timeout costs nothing and bounds how long a
                        # join waits for members that vanished without leaving.
                        max_poll_interval_ms=30_000,
                    ) as tasks_consumer,
                ):
                    self._admin, self._reader = admin, fold_reader
                    self._consumer = tasks_consumer
                    self._subscribe()
                    stream = EventStream(tasks_consumer, prod, self.topics, self.group_id)
                    await self._loop(stream, stop)
                    await self._shut_down()
            finally:
                await background.aclose()
                for lane in self.lanes.values():
                    await lane.close()
                if self.gateway is not None:
                    await self.gateway.stop()
                await self._heartbeat(WorkerStatus.STOPPED)

    # -- the loop -------------------------------------------------------------------------

    def _subscribe(self) -> None:
        assert self._consumer is not None
        self._consumer.subscribe([self.topics.name("tasks")], listener=_Rebalance(self))

    async def _loop(self, stream: EventStream, stop: asyncio.Event) -> None:
        last_commit = time.monotonic()
        while not stop.is_set():
            self.background.check()
            if any(not lane.alive for lane in self.lanes.values()):
                await self._rejoin()
            if time.monotonic() - last_commit >= self.config.commit_seconds:
                self.commit()
                last_commit = time.monotonic()
            free = self.config.concurrency - len(self.in_flight)
            consumer_ = self._consumer
            assert consumer_ is not None
            if free <= 0:
                # Full: keep polling (so the group keeps us) with every partition paused.
                consumer_.pause(*consumer_.assignment())
                self._slot_freed.clear()
                await _first(self._slot_freed.wait(), stop.wait(), within=0.5)
                await consumer_.getmany(timeout_ms=0)
                continue
            consumer_.resume(*consumer_.paused())
            batch = await stream.next_batch(timeout_ms=200, max_records=free)
            # Partitions assigned since the last batch are settled (fenced, folded) before
            # any of their records is looked at: the batch may already hold some.
            await self._settle()
            # A cancel later in the batch stops a rollout queued earlier in it from starting.
            for item in batch:
                tp = TopicPartition(item.topic, item.partition)
                ledger = self.ledgers.get(tp)
                below_floor = item.offset < self._floors.get(tp, 0)  # done by an earlier owner
                if (
                    ledger is not None
                    and not below_floor
                    and isinstance(item.event, RolloutCancelled)
                ):
                    ledger.apply(item.event)
            for item in batch:
                tp = TopicPartition(item.topic, item.partition)
                # A partition with no lane is between a revocation and its next assignment
                # (which reads it again from the committed offset) or not ours any more.
                if tp in self.lanes and item.offset >= self._floors.get(tp, 0):
                    self._handle(item)
            for tp, next_offset in batch.next_offsets.items():
                if tp in self.progress:
                    self.progress[tp].advance(next_offset)

    def _progress(self, tp: TopicPartition) -> PartitionProgress:
        return self.progress.setdefault(tp, PartitionProgress())

    def _handle(self, item: ConsumedEvent) -> None:
        tp = TopicPartition(item.topic, item.partition)
        event = item.event
        if isinstance(event, RolloutCancelled):
            self._cancelled(tp, event)
            self.ledgers[tp].planned(event.rollout_id, item.offset)
            return
        assert isinstance(event, RolloutQueued)
        ledger = self.ledgers[tp]
        ledger.planned(event.rollout_id, item.offset)
        plan = ledger.plan(event, self.in_flight.keys())
        progress = self._progress(tp)
        if plan.action is Action.SKIP:
            progress.handled(item.offset, plan.relies_on)
            self.counts["skipped"] += 1
            return
        progress.started(item.offset, plan.relies_on)
        claim = Claim(tp, item.offset)
        work: Coroutine[Any, Any, None]
        key = (event.rollout_id, event.attempt_number)
        if plan.action is Action.RUN:
            work = self._attempt(key, claim, event)
        else:
            cancel = ledger.state(event.rollout_id).cancel
            assert plan.action is Action.CANCEL
            assert cancel is not None
            work = self._end(claim, event, None, RolloutStatus.CANCELLED, cancelled_error(cancel))
        span = self.metrics.tracer.start(
            "runner.attempt" if plan.action is Action.RUN else "runner.cancel",
            attributes={
                "agl.rollout_id": event.rollout_id, "agl.attempt_number": event.attempt_number,
                "agl.mode": event.mode.value, "agl.task.partition": tp.partition,
                "agl.task.offset": item.offset,
            },
        )  # fmt: skip
        job = asyncio.create_task(self._job(key, tp, item.offset, work, span))
        self.in_flight[key] = InFlight(tp, item.offset, event, job, span=span)

    def _cancelled(self, tp: TopicPartition, event: RolloutCancelled) -> None:
        """A cancel read on one of this runner's partitions (by the loop, or earlier by the
        cancel watch): a later record of the rollout plans as cancelled, and a running
        attempt of it is stopped. Again for the same cancel, it changes nothing."""
        ledger = self.ledgers.get(tp)
        if ledger is None:
            return  # not ours (any more)
        ledger.apply(event)
        for flight in self.in_flight.values():
            if flight.task.rollout_id == event.rollout_id:
                flight.handle.request_cancel(cancelled_error(event))

    async def _job(
        self,
        key: tuple[str, int],
        tp: TopicPartition,
        offset: int,
        work: Coroutine[Any, Any, None],
        span: Span,
    ) -> None:
        """Run the work for one record; only when all its events are on the broker is the
        record finished (and its offset committable)."""
        try:
            await work
        except asyncio.CancelledError:
            self.in_flight.pop(key, None)  # handed back: the next owner runs it again
            span.set_status(Status(StatusCode.ERROR, "handed back"))
            raise
        except LaneClosed as exc:
            # Fenced or failed: what it sent is not on the topics; the partition is rejoined.
            log.warning("rollout %s attempt %s abandoned: %s", *key, exc)
            self.in_flight.pop(key, None)
            self.counts["abandoned"] += 1
            span.set_status(Status(StatusCode.ERROR, f"abandoned: {exc}"))
        except Exception as exc:
            log.exception("rollout %s attempt %s could not be recorded", *key)
            self.counts["errors"] += 1
            fail(span, exc)
            try:
                recorded = await self._fail_unrecorded(key, Claim(tp, offset), exc)
            except asyncio.CancelledError:  # handed back meanwhile: the next owner runs it
                self.in_flight.pop(key, None)
                raise
            if recorded:
                self._finished(key, tp, offset)
            else:
                self.in_flight.pop(key, None)
        else:
            self._finished(key, tp, offset)
        finally:
            span.end()
            self._slot_freed.set()

    def _finished(self, key: tuple[str, int], tp: TopicPartition, offset: int) -> None:
        self.in_flight.pop(key, None)
        progress = self.progress.get(tp)
        if progress is not None:
            progress.finished(offset)

    async def _fail_unrecorded(self, key: tuple[str, int], claim: Claim, exc: Exception) -> bool:
        """A record whose work failed in the runner itself (not in the agent, whose errors
        are the attempt's outcome): the attempt (if it started) and the rollout end failed
        with the reason, so the partition's commit moves past it instead of waiting for a
        rebalance. False when even that cannot be published (the partition moved, or the
        broker refuses)."""
        flight = self.in_flight.get(key)
        if flight is None:
            return False
        error = ErrorInfo(
            type="RunnerError", message=f"the runner could not record this rollout: {exc!r}"[:2000]
        )
        task, attempt_id = flight.task, flight.attempt_id
        finished = None
        if attempt_id is not None:
            # Its spans may be partly out: none are counted, so no reader waits for them.
            finished = AttemptFinished(
                rollout_id=task.rollout_id, attempt_id=attempt_id,
                attempt_number=task.attempt_number, worker_id=self.config.worker_id,
                status=AttemptStatus.FAILED, error=error, span_count=0,
            )  # fmt: skip
            self.counts["attempts_failed"] += 1
        try:
            await self._end(claim, task, attempt_id, RolloutStatus.FAILED, error, finished)
        except Exception:  # said; the record waits for the next owner
            log.exception(
                "rollout %s could not be failed either: %s stays uncommitted until the "
                "partition is taken over again",
                key[0], claim.tp,
            )  # fmt: skip
            return False
        return True

    # -- one rollout record -----------------------------------------------------------------

    async def _publish(self, claim: Claim, *events: tuple[str, Event]) -> None:
        """Send through the partition's lane in one transaction (all of them or none, in
        order), then wait until they are committed; what lands on the lifecycle and tasks
        topics updates the ledger, and the rollouts offsets tell the commit where the
        record's facts are."""
        pending = await self._lane(claim).send_all(list(events))
        landed = await asyncio.gather(*pending)
        for (topic, event), meta in zip(events, landed, strict=True):
            self._landed(claim, topic, event, meta)

    def _landed(self, claim: Claim, topic: str, event: Event, meta: RecordMetadata) -> None:
        ledger = self.ledgers.get(claim.tp)  # None: handed back meanwhile
        if topic == "rollouts" and ledger is not None:
            ledger.apply(event, meta.offset)
            progress = self.progress.get(claim.tp)
            if progress is not None:
                progress.wrote(meta.offset)

    def _lane(self, claim: Claim) -> Lane:
        lane = self.lanes.get(claim.tp)
        if lane is None:
            raise LaneClosed(f"{claim.tp} is no longer this runner's")
        return lane

    async def _attempt(self, key: tuple[str, int], claim: Claim, task: RolloutQueued) -> None:
        attempt_id = uuid.uuid4().hex
        began = time.monotonic()
        tracer, root = self.metrics.tracer, self.in_flight[key].span
        root.set_attribute("agl.attempt_id", attempt_id)
        with tracer.span("runner.claim", root):  # its resources version, maybe waited for
            try:
                version = self.resources.resolve(task.resources_id)
            except KeyError:
                assert task.resources_id is not None
                wait = self.config.pin_wait_seconds
                version = await self.resources.wait_for(task.resources_id, wait)
        rollout = Rollout(
            rollout_id=task.rollout_id,
            attempt_id=attempt_id,
            attempt_number=task.attempt_number,
            mode=task.mode,
            resources_id=version.resources_id if version else None,
            metadata=task.metadata,
        )
        lane = self._lane(claim)
        # Not waited for here: the lane keeps it ahead of AttemptFinished, which waits.
        started_event = AttemptStarted(
            rollout_id=task.rollout_id, attempt_id=attempt_id,
            attempt_number=task.attempt_number, worker_id=self.config.worker_id,
            resources_id=rollout.resources_id, task_offset=claim.offset,
        )  # fmt: skip
        with tracer.span("runner.start", root):
            started = await lane.send("rollouts", started_event)
        self.in_flight[key].attempt_id = attempt_id
        if task.resources_id is not None and version is None:
            message = f"no resources version {task.resources_id!r} has been published"
            error = ErrorInfo(type="UnknownResources", message=message)
            outcome = Outcome(AttemptStatus.FAILED, error, None, 0)
        else:
            resources = dict(version.resources) if version else {}
            handle = self.in_flight[key].handle
            with tracer.span("runner.agent", root) as agent:
                outcome = await execute(
                    self.config.agent, task, rollout, resources, lane, handle,
                    gateway=self.gateway, redaction=self.config.redaction,
                )  # fmt: skip
                agent.set_attribute("agl.span_count", outcome.span_count)
        root.set_attribute("agl.attempt.status", outcome.status.value)
        if outcome.reward is not None:
            root.set_attribute("agl.reward", outcome.reward)
        with tracer.span("runner.end", root):  # the attempt's end and what follows, committed
            self._landed(claim, "rollouts", started_event, await started)
            finished = AttemptFinished(
                rollout_id=task.rollout_id, attempt_id=attempt_id,
                attempt_number=task.attempt_number, worker_id=self.config.worker_id,
                status=outcome.status, error=outcome.error, span_count=outcome.span_count,
                reward=outcome.reward,
            )  # fmt: skip
            self.counts[f"attempts_{outcome.status.value}"] += 1
            self.metrics.observe(
                "attempt", time.monotonic() - began,
                "An attempt's time, its resources wait included.",
            )  # fmt: skip
            if outcome.cancelled:
                await self._end(
                    claim, task, attempt_id, RolloutStatus.CANCELLED, outcome.error, finished
                )
            else:
                await self._apply_decision(claim, task, attempt_id, outcome, finished)
            # Committed with the end or before it (the lane keeps order): done by now.
            await asyncio.gather(*outcome.spans_sent)

    async def _apply_decision(
        self, claim: Claim, task: RolloutQueued, attempt_id: str, outcome: Outcome,
        finished: AttemptFinished,
    ) -> None:  # fmt: skip
        """Publish an attempt's end together with what follows it (a retry or the rollout's
        end), in one transaction: whoever sees the end sees the decision too, so a next
        owner never decides a second time (a second retry record would run the rollout
        again after a later takeover whose fold starts past its end)."""
        decision = decide(task, attempt_id, outcome.status, outcome.error)
        if isinstance(decision, Requeue):
            await self._publish(claim, ("rollouts", finished), ("tasks", decision.queued))
            self.counts["requeued"] += 1
            self._span_of(task).set_attribute("agl.requeued", True)
        else:
            await self._end(claim, task, attempt_id, decision.status, decision.error, finished)

    async def _end(
        self,
        claim: Claim,
        task: RolloutQueued,
        attempt_id: str | None,
        status: RolloutStatus,
        error: ErrorInfo | None,
        finished: AttemptFinished | None = None,
    ) -> None:
        end = RolloutFinished(
            rollout_id=task.rollout_id, status=status, attempt_id=attempt_id,
            attempt_count=task.attempt_number if attempt_id else task.attempt_number - 1,
            error=error,
        )  # fmt: skip
        first = [("rollouts", finished)] if finished is not None else []
        await self._publish(claim, *first, ("rollouts", end))
        self.counts[f"rollouts_{status.value}"] += 1
        self._span_of(task).set_attribute("agl.rollout.status", status.value)

    def _span_of(self, task: RolloutQueued) -> Span:
        flight = self.in_flight.get((task.rollout_id, task.attempt_number))
        return flight.span if flight is not None else INVALID_SPAN

    # -- offsets, partitions ----------------------------------------------------------------

    def commit(self, only: set[TopicPartition] | None = None) -> None:
        """Hand each partition's lane its offset (the lowest unfinished record) and the fold
        start for the next owner; the lane's next transaction records them."""
        for tp, progress in self.progress.items():
            lane = self.lanes.get(tp)
            if lane is None or not lane.alive or (only is not None and tp not in only):
                continue
            checkpoint = progress.checkpoint()
            if checkpoint is None:
                continue
            lane.commit(checkpoint[0], Checkpoint(checkpoint[1]))
            # What the fold brought in serves the inherited records: kept until all are planned.
            if checkpoint[0] >= progress.inherited_until and tp in self.ledgers:
                self.counts["ledger_pruned"] += self.ledgers[tp].prune(checkpoint[0])

    async def hand_back(self, revoked: set[TopicPartition]) -> None:
        """Partitions are moving away: stop their attempts (the next owner runs them again),
        commit what finished, and close their lanes."""
        self._epoch += 1
        self._rebalancing = True
        self.cancel_watch.drop(revoked)
        jobs = [f.job for f in self.in_flight.values() if f.tp in revoked]
        if jobs:
            # A moment to finish (a rebalance revokes everything, even what stays with us).
            await asyncio.wait(jobs, timeout=HAND_BACK_GRACE_SECONDS)
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        self.commit(only=revoked)
        for tp in revoked:
            lane = self.lanes.pop(tp, None)
            if lane is not None:
                await lane.close()
            self.progress.pop(tp, None)
            self._floors.pop(tp, None)
            self.ledgers.pop(tp, None)  # the next owner (this runner too) folds again

    async def take_over(self, assigned: set[TopicPartition]) -> None:
        """The loop settles every assigned partition that has no lane before it handles a
        record of it (in this callback the consumer may already be fetching the new
        partitions, and it may even have handed the loop records of them before this
        runs). A lane of a partition not assigned now is closed."""
        self._epoch += 1
        self._rebalancing = False
        self.cancel_watch.drop(set(self.lanes) - assigned)
        for tp in set(self.lanes) - assigned:
            await self.lanes.pop(tp).close()
            self.progress.pop(tp, None)
            self._floors.pop(tp, None)
            self.ledgers.pop(tp, None)

    async def _settle(self) -> None:
        assert self._consumer is not None
        if self._rebalancing:
            return  # between revocation and assignment: nothing is ours to settle
        epoch = self._epoch
        for tp in sorted(self._consumer.assignment() - set(self.lanes)):
            await self._settle_partition(tp, epoch)
            if epoch != self._epoch:
                return

    async def _settle_partition(self, tp: TopicPartition, epoch: int) -> None:
        """Fence the partition's previous writer, then fold what its records rely on. If the
        group rebalances meanwhile, the partition is left alone (its lane closed): the new
        assignment settles what is ours then.

        The lane is the one client a takeover starts (its transactional id is the
        partition's); the reads go through the runner's admin client and reader. A client
        started per read would bootstrap again each time, and aiokafka gives a broker that
        drops packets (blackholed: nothing refuses) a request timeout at every bootstrap
        that tries it first (benchmarks/takeover_blackhole.py)."""
        admin, reader = self._admin, self._reader
        assert admin is not None, "the runner is not running"
        assert reader is not None, "the runner is not running"
        began = time.monotonic()
        lane = await retrying(lambda: self._open_lane(tp), f"fencing {tp}")
        try:
            committed, checkpoint = await retrying(
                lambda: committed_checkpoint(admin, self.group_id, tp),
                f"reading the checkpoint of {tp}",
            )
            start = checkpoint.rollouts_from if checkpoint is not None else 0
            rollouts = TopicPartition(self.topics.name("rollouts"), tp.partition)
            ends = await retrying(lambda: reader.end_offsets([tp]), f"the end of {tp}")
            events, rollouts_end = await self._polling(
                retrying(
                    lambda: read_partition_with(reader, rollouts, start), f"folding {rollouts}"
                )
            )
        except BaseException:
            await lane.close()
            raise
        assert self._consumer is not None
        if epoch != self._epoch or tp not in self._consumer.assignment():
            await lane.close()  # rebalanced meanwhile
            return
        self.lanes[tp] = lane
        ledger = self.ledgers[tp] = Ledger()
        for offset, event in events:
            ledger.apply(event, offset)
        # From the committed offset: what lies below it is done, and what the consumer
        # already holds above it may be a cancel it has not handled yet (read twice: no harm).
        self.cancel_watch.add(tp, committed if committed is not None else 0)
        self.counts["takeover_records_read"] += len(events)
        seconds = time.monotonic() - began
        self.takeovers.append(Takeover(tp, len(events), seconds))
        self.counts["takeovers"] += 1
        self.counts["takeover_ms_last"] = round(seconds * 1000)
        self.progress[tp] = PartitionProgress(
            next_offset=committed,
            rollouts_end=rollouts_end,
            inherited_from=start,
            inherited_until=ends[tp],
        )
        if committed is not None:
            # The consumer may have fetched from an older commit (the previous owner's last
            # transaction committed after the group handed out its offsets).
            self._floors[tp] = committed
            with contextlib.suppress(IllegalStateError):  # revoked this instant
                if await self._consumer.position(tp) < committed:
                    self._consumer.seek(tp, committed)

    async def _polling(self, work: Coroutine[Any, Any, T]) -> T:
        """Await `work` while polling the group every second with every partition paused, so
        that a long fold (a partition with no checkpoint yet) does not exceed the poll
        interval and drop this runner from the group."""
        task = asyncio.ensure_future(work)
        consumer_ = self._consumer
        assert consumer_ is not None
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=1.0)
                if done:
                    return task.result()
                consumer_.pause(*consumer_.assignment())
                await consumer_.getmany(timeout_ms=0)
        finally:  # never left reading on the shared reader after a failure
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _open_lane(self, tp: TopicPartition) -> Lane:
        # Bootstrapped from a broker that answers now, never one that drops packets.
        lane = Lane(
            await reachable(self.kafka), self.topics, self.group_id, tp.partition,
            interval=self.config.transaction_seconds, linger_ms=self.config.linger_ms,
        )  # fmt: skip
        await lane.open()
        return lane

    async def _rejoin(self) -> None:
        """A lane failed (fenced by a new owner, or a transaction refused): give up every
        partition and join the group again; what is still ours comes back with new lanes."""
        failed = [str(tp) for tp, lane in self.lanes.items() if not lane.alive]
        log.warning("rejoining the group: the lanes of %s failed", ", ".join(failed))
        self.counts["rejoins"] += 1
        await self.hand_back(set(self.progress) | set(self.lanes))
        assert self._consumer is not None
        self._consumer.unsubscribe()
        self._subscribe()

    async def _shut_down(self) -> None:
        await self._heartbeat(WorkerStatus.STOPPING)
        jobs = [f.job for f in self.in_flight.values()]
        if jobs:
            await asyncio.wait(jobs, timeout=self.config.shutdown_grace_seconds)
        await self.hand_back(set(self.progress) | set(self.lanes))

    # -- resources, heartbeats -----------------------------------------------------------------

    async def _follow_resources(self) -> None:
        assert self._producer is not None
        await follow_resources(
            self.kafka, self._producer, self.resources, self.config.worker_id,
            loaded=self._resources_loaded.set,
        )  # fmt: skip

    async def _heartbeats(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            status = WorkerStatus.BUSY if self.in_flight else WorkerStatus.IDLE
            await self._heartbeat(status)
            await _first(stop.wait(), within=self.config.heartbeat_seconds)

    async def _heartbeat(self, status: WorkerStatus) -> None:
        if self._publisher is None:
            return
        await self._publisher.publish(
            "workers",
            WorkerHeartbeat(
                worker_id=self.config.worker_id, role=WorkerRole.RUNNER, status=status,
                hostname=socket.gethostname(), pid=os.getpid(),
                current_rollouts=tuple(sorted({key[0] for key in self.in_flight})),
                counts=self._counts(), interval_seconds=self.config.heartbeat_seconds,
            ),
        )  # fmt: skip

    def _counts(self) -> dict[str, int]:
        counts = dict(self.counts)
        counts["ledger_rollouts"] = sum(len(ledger.rollouts) for ledger in self.ledgers.values())
        counts["in_flight"] = len(self.in_flight)
        if self.gateway is not None:
            counts.update({f"gateway_{k}": v for k, v in self.gateway.counts.items()})
        return counts

    def _partition_lag(self) -> dict[tuple[str, int], int]:
        """Per owned tasks partition: records from the lowest one not finished to the end."""
        lag: dict[tuple[str, int], int] = {}
        if self._consumer is None:
            return lag
        assigned = self._consumer.assignment()  # highwater() refuses other partitions
        for tp, progress in self.progress.items():
            position = progress.commit_position()
            end = self._consumer.highwater(tp) if tp in assigned else None
            if position is not None and end is not None:
                lag[(tp.topic, tp.partition)] = max(0, end - position)
        return lag


async def _first(*aws: Coroutine[Any, Any, Any], within: float | None = None) -> None:
    """Wait until the first of `aws` completes, or `within` seconds pass."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, timeout=within, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
