"""`agl-stream worker trainer`: finished train-mode attempts in, checkpoints and
resources versions out.

The trainer reads the co-partitioned tasks, rollouts and spans topics from the offsets saved
with its latest checkpoint, assembles whole trajectories, and when enough groups are full
runs one update, writes a checkpoint with the offset range the step consumed, then publishes
a resources version pointing at it. Killed at any point it resumes from its latest
checkpoint: records after that checkpoint's cut are read again, and the attempts it already
trained on (remembered in the checkpoint) are skipped, so no data is repeated or skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from opentelemetry.trace import Span

from agl_stream.agent.llm import DEFAULT_POLICY
from agl_stream.bus.kafka import consumer, producer
from agl_stream.bus.roles import role
from agl_stream.bus.streams import EventPublisher, EventStream, Topics
from agl_stream.bus.topic_admin import ensure_topics_ready
from agl_stream.commands.resources import (
    Change,
    ResourceCache,
    ResourcesPublisher,
    follow_resources,
)
from agl_stream.events import (
    Checkpoint,
    ResourcesPublished,
    WorkerHeartbeat,
    WorkerRole,
    WorkerStatus,
)
from agl_stream.runtime.config import ConfigError, KafkaSettings
from agl_stream.runtime.supervision import Supervisor, restarting
from agl_stream.telemetry.metrics import WorkerMetrics
from agl_stream.training.batching import Groups, Staleness, StepInput, build_step, policy_step
from agl_stream.training.checkpoints import OPTIMIZER_FILE, CheckpointStore, checkpoint_root
from agl_stream.training.device import CPU, Placement
from agl_stream.training.grpo import GRPO, GRPOConfig, UpdateStats
from agl_stream.training.hf import Policy, quiet_transformers
from agl_stream.training.lora import LoraSettings, load_adapter, with_adapter
from agl_stream.training.model import (
    SEEDED_INIT,
    TINY,
    TINY_CHAT,
    content_hash,
    initial_policy,
    load_policy,
    save_policy,
    set_threads,
)
from agl_stream.training.pretrained import resolve_model
from agl_stream.training.retention import InFlight, prunable
from agl_stream.training.trajectories import (
    TRAINED_TOPICS,
    Assembler,
    LateRewardRule,
    Trajectory,
    partition_of,
)
from agl_stream.training.trajectories import TopicPartition as TP
from agl_stream.training.triplets import RewardRule
from agl_stream.training.update import PolicyUpdate, UpdateFactory

log = logging.getLogger(__name__)

MAX_PROBLEMS_KEPT = 20
# A step waits this long at most for the versions its samples ran on to be folded.
VERSION_FOLD_WAIT = 10.0


@dataclass
class TrainerConfig:
    checkpoint_dir: str
    init_model: str = "tiny"
    run_name: str = "grpo"
    # The policy this trainer trains: the LLM calls that name it (agl.llm.policy; a call
    # naming none is the default policy's), the resource its versions publish, part of their
    # ids (<run_name>-<policy>-v<n>; the default policy's are <run_name>-v<n>) and of its
    # consumer group. Several policies: one trainer each, each with a checkpoint_dir of its own.
    policy: str = DEFAULT_POLICY
    # Only the calls made inside the spans of agents whose names this regular expression
    # matches (Agent Lightning's agent_match, agent_match.py); None: every call of the policy.
    agent_match: str | None = None
    group_size: int = 8
    groups_per_step: int = 8
    reward_rule: RewardRule = RewardRule.FINAL
    # Train on a reward given after the attempt (RewardRecorded) instead of its own.
    late_reward: LateRewardRule | None = None
    staleness: Staleness = field(default_factory=Staleness)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    max_steps: int | None = None
    publish: bool = True  # False: an offline retrain that publishes nothing
    start: Mapping[TP, int] | None = None  # where a fresh run starts (default: the beginning)
    start_latest: bool = False  # a fresh run starts at the end: only attempts from now on
    until: Mapping[TP, int] | None = None  # stop when every partition reaches these offsets
    from_time: datetime | None = None  # skip records the broker stamped earlier
    until_time: datetime | None = None  # a partition ends at its first record stamped later
    group_id: str | None = None
    worker_id: str = field(default_factory=lambda: f"trainer-{socket.gethostname()}-{os.getpid()}")
    heartbeat_seconds: float = 5.0
    threads: int = 1
    placement: Placement = CPU  # the device and dtype of the policy (device.py)
    lora: LoraSettings | None = None  # train an adapter on a frozen base, not the whole model
    keep: int | None = None  # keep the last N checkpoints and the live ones (retention.py)
    # The update step (default: GRPO with `grpo`); anything with PolicyUpdate's methods.
    update: UpdateFactory | None = None
    patience_records: int = 50_000
    # Trajectories waiting for their group; past it the oldest groups that are not full are
    # dropped (counted as dropped_incomplete), so that memory stays bounded.
    max_waiting: int = 10_000
    prune_records: int = 20_000  # between steps, forget what lies below the cut this often


@dataclass
class StepReport:
    step: int
    version: int
    resources_id: str
    mean_reward: float
    counts: dict[str, int]
    stats: UpdateStats | None
    seconds: float


def trainer_group(topic_prefix: str, policy: str = DEFAULT_POLICY) -> str:
    """The group the trainer commits its cut to (for `status`; its checkpoints are the truth):
    workers/trainer.toml's, with the policy's name after it for a policy other than the
    default."""
    group = role("trainer").group_id(topic_prefix)
    return group if policy == DEFAULT_POLICY else f"{group}-{policy}"


class Trainer:
    def __init__(
        self,
        kafka: KafkaSettings,
        config: TrainerConfig,
        on_step: Callable[[StepReport], None] | None = None,
    ) -> None:
        self.kafka = kafka
        self.config = config
        self.topics = Topics(kafka)
        self.store = CheckpointStore(config.checkpoint_dir)
        self.on_step = on_step
        self.group_id = config.group_id or trainer_group(kafka.topic_prefix, config.policy)
        self.counts: Counter[str] = Counter()
        self.step = 0
        self.version = 0
        self.resources_id = ""
        self.positions: dict[TP, int] = {}
        self.cut: dict[TP, int] = {}
        self.assembler = Assembler(config.patience_records, config.late_reward)
        self.groups = Groups(config.group_size, config.groups_per_step, config.max_waiting)
        # resources id -> the step of this trainer's policy that the version holds, for
        # staleness: counted in policy updates, whoever published versions in between.
        self.versions: dict[str, int] = {}
        self.resources = ResourceCache()  # folded from the resources topic while it runs
        self._noted: set[str] = set()  # versions _note_versions has looked at
        self._resources_out: ResourcesPublisher | None = None
        self._time_stops: dict[TP, int] = {}
        self._evicted: list[Trajectory] = []
        self._late_dropped: list[Trajectory] = []  # no late reward in time: lineage only
        self._dropped_incomplete = 0  # since the last step
        self._unpruned_records = 0
        self._policy: Policy | None = None
        self._grpo: PolicyUpdate | None = None
        self._base: dict[str, str] | None = None  # a LoRA run's base model: uri, content_hash
        self.in_flight = InFlight()  # versions named by rollouts queued or running
        self._publisher: EventPublisher | None = None
        self.metrics = WorkerMetrics("trainer", self._snapshot)

    # -- the loop ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        await ensure_topics_ready(self.kafka, (*TRAINED_TOPICS, "resources", "workers", "dlq"))
        quiet_transformers()
        set_threads(self.config.threads)
        async with (
            producer(self.kafka) as prod,
            consumer(self.kafka, group_id=self.group_id) as cons,
            Supervisor() as background,
            self._following_resources(prod, background),
            ResourcesPublisher(self.kafka, self.config.worker_id) as resources_out,
        ):
            self._publisher = EventPublisher(prod, self.topics)
            self._resources_out = resources_out
            tps = self._partitions()
            await self._resume_or_start(cons, tps)
            await self._publish_current()
            cons.assign([TopicPartition(self.topics.name(t), p) for t, p in tps])
            for (topic, partition), offset in self.positions.items():
                cons.seek(TopicPartition(self.topics.name(topic), partition), offset)
            stream = EventStream(cons, prod, self.topics, self.config.worker_id)
            beats = background.spawn(
                restarting(lambda: self._heartbeats(stop), "the heartbeats"),
                "the heartbeats",
                may_return=True,
            )
            try:
                await self._consume(stream, cons, stop, background)
            finally:
                beats.cancel()
                await self._heartbeat(WorkerStatus.STOPPED)

    @contextlib.asynccontextmanager
    async def _following_resources(
        self, prod: AIOKafkaProducer, background: Supervisor
    ) -> AsyncIterator[None]:
        """Fold the resources topic into self.resources from its start, and go on folding
        while the trainer runs (a failure is logged and the follower starts again)."""
        loaded = asyncio.Event()
        name = self.config.worker_id
        following = background.spawn(
            restarting(
                lambda: follow_resources(self.kafka, prod, self.resources, name, loaded.set),
                "the resources follower",
            ),
            "the resources follower",
        )
        try:
            await background.watch(loaded.wait())
            self._note_versions()
            yield
        finally:
            following.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await following  # its consumer closes before the producer it dead-letters to

    async def _consume(
        self,
        stream: EventStream,
        cons: AIOKafkaConsumer,
        stop: asyncio.Event,
        background: Supervisor,
    ) -> None:
        short = {self.topics.name(t): t for t in TRAINED_TOPICS}
        while not stop.is_set() and not self._done():
            background.check()
            batch = await stream.next_batch(timeout_ms=500, max_records=5000)
            for item in batch:
                tp = (short[item.topic], item.partition)
                if self._in_range(tp, item.offset, item.timestamp_ms):
                    self.assembler.add(tp, item.offset, item.event, item.timestamp_ms)
                self.in_flight.add(tp, item.offset, item.event)
            for tp, offset in batch.next_offsets.items():
                self.positions[(short[tp.topic], tp.partition)] = offset
            if self.config.late_reward is not None and self.config.until is None:
                self._tick(cons)
            self._late_dropped += self.assembler.dropped()
            self.counts["records"] += len(batch)
            self.counts["dead_lettered"] += batch.dead_lettered
            self.groups.add(self.assembler.complete())
            self._drop_overflow()
            self._evict_stale()
            self._prune_between_steps(len(batch))
            while self.groups.ready() and not self._done():
                await self._versions_folded()
                await self._train_step(cons)
                self._evict_stale()  # a new version makes more samples stale

    def _tick(self, cons: AIOKafkaConsumer) -> None:
        """Live, the broker's time goes on in rollouts partitions read to their end (a
        late reward appended from now on is stamped from now on): an offline retrain
        judges by the records' times alone."""
        caught_up = []
        for partition in range(self.topics.specs["rollouts"].partitions):
            tp = TopicPartition(self.topics.name("rollouts"), partition)
            end = cons.highwater(tp)
            if end is not None and self.positions.get(("rollouts", partition), 0) >= end:
                caught_up.append(("rollouts", partition))
        self.assembler.tick(int(time.time() * 1000), caught_up)

    def _in_range(self, tp: TP, offset: int, timestamp_ms: int | None) -> bool:
        """Whether a record is inside a retrain's time and offset bounds."""
        cfg = self.config
        millis = timestamp_ms or 0
        if cfg.until is not None and offset >= cfg.until.get(tp, offset + 1):
            return False
        if offset >= self._time_stops.get(tp, offset + 1):
            return False
        if cfg.until_time is not None and millis > cfg.until_time.timestamp() * 1000:
            self._time_stops[tp] = offset
            return False
        return cfg.from_time is None or millis >= cfg.from_time.timestamp() * 1000

    def _done(self) -> bool:
        cfg = self.config
        if cfg.max_steps is not None and self.step >= cfg.max_steps:
            return True
        if cfg.until is not None:
            ends = {tp: min(end, self._time_stops.get(tp, end)) for tp, end in cfg.until.items()}
            reached = all(self.positions.get(tp, 0) >= end for tp, end in ends.items())
            return reached and not self.groups.ready()
        return False

    def _evict_stale(self) -> None:
        """Samples the staleness rule drops leave their groups now; the next step consumes
        them (its lineage lists them) without training on them."""
        rule = self.config.staleness
        self._note_versions()

        def too_stale(t: Trajectory) -> bool:
            if (t.resources_id or "") not in self.resources.versions:
                return False  # not folded yet (the runner saw it first): judged later
            return rule.weight(self.versions.get(t.resources_id or ""), self.step) is None

        self._evicted += self.groups.evict(too_stale)

    async def _versions_folded(self) -> None:
        """Under a staleness bound a step's samples are judged by the versions they ran on.
        A version a runner saw that this trainer's resources follower has not folded yet is
        waited for (up to VERSION_FOLD_WAIT seconds), not judged unknown, hence too stale."""
        if self.config.staleness.max_versions is None:
            return
        deadline = time.monotonic() + VERSION_FOLD_WAIT
        while True:
            change = self.resources.next_change()  # before looking: no change missed
            unfolded = {
                t.resources_id for t in self.groups.next_step()
                if t.resources_id and t.resources_id not in self.resources.versions
            }  # fmt: skip
            remaining = deadline - time.monotonic()
            if not unfolded or remaining <= 0:
                break
            self.counts["version_fold_waits"] += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(change.wait(), remaining)
        self._note_versions()

    def _drop_overflow(self) -> None:
        """Groups that do not fill while others arrive leave past the bound: settled at once
        (never handed out again, not kept in memory), counted in the next step's lineage."""
        dropped = self.groups.overflow()
        if not dropped:
            return
        self.assembler.settle([t.key for t in dropped], "attempts_dropped_incomplete")
        self._dropped_incomplete += len(dropped)
        self.counts["dropped_incomplete"] += len(dropped)
        log.warning(
            "%d trajectories left groups that were not full (more than %d waiting); "
            "is --group-size larger than the attempts each task gets?",
            len(dropped), self.config.max_waiting,
        )  # fmt: skip

    def _prune_between_steps(self, records: int) -> None:
        """What the assembler settled lies below the cut soon: forgotten now and then, not
        only at steps, so that its memory stays bounded when steps are rare."""
        self._unpruned_records += records
        if self._unpruned_records < self.config.prune_records:
            return
        self._unpruned_records = 0
        self.assembler.prune(self.assembler.cut(self.positions))

    # -- one step ---------------------------------------------------------------------------

    async def _train_step(self, cons: AIOKafkaConsumer) -> None:
        """One step, traced as trainer.step with its phases as children."""
        attributes = {"agl.step": self.step + 1}
        with self.metrics.tracer.span("trainer.step", attributes=attributes) as span:
            report = await self._step(cons, span)
            span.set_attributes({
                "agl.samples": report.counts.get("samples", 0), "agl.version": report.version,
                "agl.resources_id": report.resources_id, "agl.mean_reward": report.mean_reward,
            })  # fmt: skip
        if self.on_step is not None:
            self.on_step(report)

    async def _step(self, cons: AIOKafkaConsumer, span: Span) -> StepReport:
        assert self._grpo is not None
        tracer = self.metrics.tracer
        started = time.monotonic()
        timings: dict[str, float] = {"ready_at": time.time()}  # the groups filled
        self._note_versions()
        with tracer.span("trainer.build", span):
            step_input = build_step(
                self.groups.take(),
                self.versions,
                self.step,
                self.config.staleness,
                self.config.reward_rule,
                self.config.grpo.scale_rewards,
                self.config.policy,
                self.config.agent_match,
            )
        evicted, self._evicted = self._evicted, []
        step_input.used += [t.key for t in evicted]
        step_input.counts["dropped_stale"] += len(evicted)
        late, self._late_dropped = self._late_dropped, []
        step_input.used += [t.key for t in late]
        if late:
            step_input.counts["late_reward_dropped"] = len(late)
        if self._dropped_incomplete:
            step_input.counts["dropped_incomplete"] = self._dropped_incomplete
            self._dropped_incomplete = 0
        stats = None
        timings["build_s"] = time.monotonic() - started
        with tracer.span("trainer.update", span, {"agl.samples": len(step_input.samples)}):
            if step_input.samples:  # none when every group's rewards were equal
                stats = await asyncio.to_thread(self._grpo.update, step_input.samples)
        timings["update_s"] = time.monotonic() - started - timings["build_s"]
        for problem in step_input.problems[:MAX_PROBLEMS_KEPT]:
            log.warning("left out of step %d: %s", self.step + 1, problem)
        self.assembler.settle(step_input.used)
        cut = self.assembler.cut(self.positions)
        self.assembler.prune(cut)
        consumed = {tp: (self.cut.get(tp, 0), end) for tp, end in cut.items()}
        self.step += 1
        state = self._state(cut, consumed, step_input, stats)
        state["timings"] = timings
        written = time.monotonic()
        with tracer.span("trainer.checkpoint", span):
            await asyncio.to_thread(self._write_checkpoint, state)
        self.cut = cut
        published = time.monotonic()
        with tracer.span("trainer.publish", span):
            await self._publish_current()
        await self._prune()
        phases = {
            "update": timings["build_s"] + timings["update_s"],
            "checkpoint": published - written,
            "publish": time.monotonic() - published,
        }
        for phase, seconds in phases.items():
            self.metrics.observe(phase, seconds, f"A step's {phase}.")
        if cut:
            with tracer.span("trainer.commit", span):
                await cons.commit({
                    TopicPartition(self.topics.name(t), p): o for (t, p), o in cut.items()
                })  # fmt: skip
        self.counts["steps"] += 1
        self.counts["samples"] += len(step_input.samples)
        self.counts.update({k: v for k, v in step_input.counts.items() if "stale" in k})
        report = StepReport(
            self.step, self.version, self.resources_id, step_input.mean_reward,
            dict(step_input.counts), stats, time.monotonic() - started,
        )  # fmt: skip
        log.info("step %d: mean reward %.3f, %s", report.step, report.mean_reward, report.counts)
        self.metrics.observe("step", report.seconds, "A step: update, checkpoint and publish.")
        self.metrics.set("mean_reward", report.mean_reward, "The latest step's mean reward.")
        return report

    def _state(
        self,
        cut: Mapping[TP, int],
        consumed: Mapping[TP, tuple[int, int]],
        step_input: StepInput | None,
        stats: UpdateStats | None,
    ) -> dict[str, Any]:
        def name(tp: TP) -> str:
            return f"{tp[0]}:{tp[1]}"

        counts = dict(step_input.counts) if step_input else {}
        counts.update({f"assembler_{k}": v for k, v in self.assembler.counts.items()})
        return {
            "step": self.step,
            "run_name": self.config.run_name,
            "policy": self.config.policy,
            "created_at": time.time(),
            "cut": {name(tp): offset for tp, offset in sorted(cut.items())},
            "consumed": {name(tp): list(r) for tp, r in sorted(consumed.items())},
            "used": [list(k) for k in step_input.used] if step_input else [],
            "mean_reward": step_input.mean_reward if step_input else None,
            "rewards": step_input.rewards if step_input else [],
            "counts": counts,
            "problems": [str(p) for p in step_input.problems[:MAX_PROBLEMS_KEPT]]
            if step_input
            else [],
            "stats": vars(stats) if stats else None,
            "assembler": self.assembler.memory(),
            "in_flight": self.in_flight.memory(),
            "base": self._base,
            "placement": vars(self.config.placement),
        }

    def _write_checkpoint(self, state: dict[str, Any]) -> None:
        import torch

        assert self._policy is not None
        assert self._grpo is not None
        policy, grpo = self._policy, self._grpo

        def fill(directory: Path) -> None:
            save_policy(policy, directory)  # a LoRA run's: the adapter only
            torch.save(grpo.state_dict(), directory / OPTIMIZER_FILE)

        self.store.write(self.step, fill, state)

    async def _prune(self) -> None:
        """Under --keep N: delete the checkpoints that are neither among the last N nor
        named by a live version (retention.py says what is live)."""
        if self.config.keep is None:
            return
        live = {self.step}
        named = self.in_flight.versions()
        latest = self.resources.latest
        # The version just published is the latest even before the follower folds it.
        if latest is not None and not (self.config.publish and latest.version < self.version):
            named.add(latest.resources_id)
        for rid in named:
            event = self.resources.versions.get(rid)
            policy = event.resources.get(self.config.policy) if event else None
            step = self.store.step_of(policy.uri) if isinstance(policy, Checkpoint) else None
            if step is not None:
                live.add(step)
        doomed = prunable(self.store.steps(), self.config.keep, live)
        if doomed:
            await asyncio.to_thread(self.store.prune, doomed)
            self.counts["checkpoints_pruned"] += len(doomed)
            log.info("pruned the checkpoints of steps %s", doomed)

    # -- start and resume ---------------------------------------------------------------------

    def _partitions(self) -> list[TP]:
        return [(t, p) for t in TRAINED_TOPICS for p in range(self.topics.specs[t].partitions)]

    async def _resume_or_start(self, cons: AIOKafkaConsumer, tps: list[TP]) -> None:
        self.store.clean_partial()
        latest = await asyncio.to_thread(self.store.latest)  # an object store: a download
        if latest is not None:
            await asyncio.to_thread(self._resume, latest)
            return
        firsts = await cons.beginning_offsets(
            [TopicPartition(self.topics.name(t), p) for t, p in tps]
        )
        if self.config.start_latest:
            firsts = await cons.end_offsets(list(firsts))
        begin = {(t, p): firsts[TopicPartition(self.topics.name(t), p)] for t, p in tps}
        self.cut = {tp: max(begin[tp], (self.config.start or {}).get(tp, 0)) for tp in tps}
        self.positions = dict(self.cut)
        self._policy = await asyncio.to_thread(self._fresh_policy)
        self._grpo = self._new_update()
        await asyncio.to_thread(self._write_checkpoint, self._state(self.cut, {}, None, None))

    def _fresh_policy(self) -> Policy:
        with SEEDED_INIT:  # a LoRA adapter's initial weights come from the global generator
            return self._fresh_policy_drawn()

    def _fresh_policy_drawn(self) -> Policy:
        cfg = self.config
        policy = initial_policy(cfg.init_model, cfg.grpo.seed, cfg.placement)
        if cfg.lora is None:
            return policy
        if cfg.init_model in (TINY, TINY_CHAT):  # a base that exists only here: saved once
            base = self.store.write_base(lambda directory: save_policy(policy, directory))
        else:  # a pretrained model's name or a GGUF file: its converted folder
            base = checkpoint_root(str(resolve_model(cfg.init_model)))
        self._base = {"uri": base.as_uri(), "content_hash": content_hash(base)}
        return with_adapter(policy, cfg.lora)

    def _new_update(self) -> PolicyUpdate:
        assert self._policy is not None
        if self.config.update is not None:
            return self.config.update(self._policy.model, self._pad_id())
        return GRPO(self._policy.model, self._pad_id(), self.config.grpo)

    def _resume(self, directory: Path) -> None:
        import torch

        step = int(directory.name.split("-")[1])
        state = self.store.state(step)
        held = state.get("policy", DEFAULT_POLICY)
        if held != self.config.policy:
            raise ConfigError(
                f"{self.store.root} holds the checkpoints of policy {held!r}: policy "
                f"{self.config.policy!r} (--policy) needs a --checkpoint-dir of its own"
            )
        self.step = state["step"]
        self.cut = {partition_of(name): offset for name, offset in state["cut"].items()}
        self.positions = dict(self.cut)
        self.assembler = Assembler.resume(
            state["assembler"], self.config.patience_records, self.config.late_reward
        )
        self.in_flight = InFlight.resume(state.get("in_flight", {}))
        self._policy = self._resumed_policy(directory, state.get("base"))
        self._grpo = self._new_update()
        where = self.config.placement.device
        saved = torch.load(directory / OPTIMIZER_FILE, weights_only=False, map_location=where)
        self._grpo.load_state_dict(saved)
        log.info("resumed from %s (step %d)", directory, self.step)

    def _resumed_policy(self, directory: Path, base: dict[str, str] | None) -> Policy:
        where, root = self.config.placement, self.store.root
        if base is None and self.config.lora is not None:
            raise ConfigError(
                f"{root} holds whole-model checkpoints: a LoRA run (--lora-rank, "
                "--lora-config) needs a --checkpoint-dir of its own"
            )
        if base is None:
            return load_policy(directory, where)
        if self.config.lora is None:
            raise ConfigError(
                f"{root} holds LoRA adapters: pass --lora-rank or --lora-config to go on "
                "training them, or use another --checkpoint-dir"
            )
        base_dir = checkpoint_root(base["uri"])
        found = content_hash(base_dir)
        if found != base["content_hash"]:
            raise ConfigError(
                f"the base model of the adapters in {root}, {base_dir}, hashes to {found}, "
                f"not {base['content_hash']} as when they were trained: it changed"
            )
        self._base = base
        return load_adapter(load_policy(base_dir, where), directory, trainable=True)

    def _pad_id(self) -> int:
        assert self._policy is not None
        pad = self._policy.tokenizer.pad_token_id
        return int(pad if pad is not None else self._policy.tokenizer.eos_token_id or 0)

    # -- resources ----------------------------------------------------------------------------

    def _note_versions(self) -> None:
        """Which of this trainer's policy steps each version folded since the last call
        holds (for staleness; a version holding none of its checkpoints has no step)."""
        versions = self.resources.versions
        if len(versions) == len(self._noted):
            return
        for rid, event in list(versions.items()):
            if rid in self._noted:
                continue
            self._noted.add(rid)
            step = policy_step(event.resources, self.config.policy, self.store.step_of)
            if step is not None:
                self.versions[rid] = step

    def _own_version(self, step: int) -> ResourcesPublished | None:
        """The version holding this store's checkpoint of `step`, if one is published (the
        trainer was stopped between publishing it and its next step)."""
        for event in self.resources.versions.values():
            policy = event.resources.get(self.config.policy)
            if (
                event.metadata.get("step") == str(step)
                and event.metadata.get("policy", DEFAULT_POLICY) == self.config.policy
                and isinstance(policy, Checkpoint)
                and self.store.step_of(policy.uri) == step
            ):
                return event
        return None

    async def _publish_current(self) -> None:
        """Publish the latest checkpoint as a new resources version: the policy on top of
        the latest version's other resources (a prompt, an endpoint), numbered by the
        topic (resources.py); a restart finds the step's version if it is out already."""
        directory = self.store.step_dir(self.step)
        checkpoint = Checkpoint(uri=self.store.uri(self.step), content_hash=content_hash(directory))
        if self._base is not None:  # a LoRA adapter, applied to the base it names
            checkpoint = Checkpoint(
                uri=checkpoint.uri, content_hash=checkpoint.content_hash, format="peft",
                base_uri=self._base["uri"], base_content_hash=self._base["content_hash"],
            )  # fmt: skip
        if not self.config.publish or self._resources_out is None:
            self.resources_id = f"{self.config.run_name}-step{self.step}"
            return
        state = await asyncio.to_thread(self.store.state, self.step)
        cfg = self.config
        metadata = {"step": str(self.step), "run_name": cfg.run_name, "policy": cfg.policy}
        if state.get("mean_reward") is not None:
            metadata["mean_reward"] = f"{state['mean_reward']:.6f}"
        for key in (
            "samples", "trajectories", "dropped_stale", "downweighted_stale", "dropped_incomplete",
            "late_reward_late", "late_reward_fallback", "late_reward_dropped",
        ):  # fmt: skip
            if key in state["counts"]:
                metadata[key] = str(state["counts"][key])
        found = self._own_version(self.step)
        if found is not None and found.resources[cfg.policy] == checkpoint:
            event = found  # a restart finds it instead of publishing it again
        else:
            previous = self._own_version(self.step - 1) if self.step > 0 else None
            parent = self.resources_id or (previous.resources_id if previous else None)
            prefix = (
                cfg.run_name if cfg.policy == DEFAULT_POLICY else f"{cfg.run_name}-{cfg.policy}"
            )
            event = await self._resources_out.publish(
                Change(
                    resources={cfg.policy: checkpoint}, id_prefix=prefix,
                    parent_resources_id=parent, metadata=metadata,
                    # Out already (a commit that succeeded unacknowledged): found, not doubled.
                    same_as=lambda v: v.metadata.get("run_name") == cfg.run_name
                    and v.metadata.get("step") == str(self.step)
                    and v.resources.get(cfg.policy) == checkpoint,
                )
            )  # fmt: skip
        self.resources_id, self.version = event.resources_id, event.version
        self.versions[event.resources_id] = self.step

    def _snapshot(self) -> dict[str, int]:
        """What heartbeats and metrics count."""
        counts = dict(self.counts)
        counts["step"] = self.step
        counts["waiting_trajectories"] = self.groups.waiting()
        counts["pending_rollouts"] = len(self.assembler.pending)
        return counts

    # -- heartbeats ---------------------------------------------------------------------------

    async def _heartbeats(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._heartbeat(WorkerStatus.BUSY)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.heartbeat_seconds)

    async def _heartbeat(self, status: WorkerStatus) -> None:
        if self._publisher is None:
            return
        counts = self._snapshot()
        await self._publisher.publish(
            "workers",
            WorkerHeartbeat(
                worker_id=self.config.worker_id, role=WorkerRole.TRAINER, status=status,
                hostname=socket.gethostname(), pid=os.getpid(), counts=counts,
                interval_seconds=self.config.heartbeat_seconds,
            ),
        )  # fmt: skip
