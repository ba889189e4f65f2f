"""`agl-stream worker trainer --algorithm apo`: prompt optimisation by measured reward.

Round 0 measures the seed template on the validation tasks. Each later round, for every
template in the beam: run it on a sample of the training tasks, show the attempts that went
worst to the optimizer LLM for a critique, ask for `branch` rewrites that follow it, and
measure each valid rewrite on the validation tasks. The beam keeps the best `width`
templates by mean validation reward; when its best changes, it is published as the new
latest resources version.

Candidates run as pin-only versions (metadata pin_only=true): runners use one only for the
rollouts that pin it, so other work keeps the latest. Results are read from the PostgreSQL
read model, so a projector must be running. Every step is written to the state file before
its effect; a restarted optimizer republishes the same versions and queues only the
rollouts that are not on the tasks topic yet, so nothing is lost or done twice.

Its metrics (agl_stream_apo_*: rounds, candidates, rollouts by status, the best score, round
and batch times) are served by `--metrics-port`; each round is a span (apo.round) with its
batches and optimizer calls as children when OTLP export is on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokafka import TopicPartition
from opentelemetry.trace import Span

from agl_stream.agent.llm import LLM_CALL_SPAN
from agl_stream.bus.kafka import end_offsets, producer
from agl_stream.bus.streams import EventPublisher, Topics
from agl_stream.bus.topic_admin import ensure_topics_ready
from agl_stream.commands.enqueue import RolloutOptions, make_rollout
from agl_stream.commands.resources import Change, ResourcesPublisher, read_resources
from agl_stream.events import (
    PromptTemplate,
    ResourcesPublished,
    RolloutMode,
    TemplateEngine,
)
from agl_stream.events.templates import TemplateError
from agl_stream.queries import ReadModel
from agl_stream.queries.models import Rollout
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings
from agl_stream.telemetry.metrics import WorkerMetrics
from agl_stream.telemetry.spans import Attributes
from agl_stream.training.apo.prompts import (
    Example,
    check_candidate,
    critique_messages,
    read_candidate,
    rewrite_messages,
)
from agl_stream.training.apo.search import (
    STATE_FILE,
    ApoState,
    Candidate,
    Published,
    sample_tasks,
    select_beam,
    tasks_digest,
    worst,
)
from agl_stream.training.checkpoints import checkpoint_root
from agl_stream.training.triplets import call_messages

log = logging.getLogger(__name__)


class ApoError(RuntimeError):
    """APO cannot go on; the message says why."""


@dataclass
class ApoConfig:
    state_dir: str
    train_tasks: Sequence[Any]
    val_tasks: Sequence[Any]
    optimizer_endpoint: str
    optimizer_model: str
    optimizer_api_key: str = "not-needed"
    critique_model: str | None = None  # the model asked for critiques (default optimizer_model)
    prompt_name: str = "prompt"
    seed_template: str | None = None  # default: the latest version's prompt_name resource
    engine: TemplateEngine = TemplateEngine.F_STRING
    run_name: str = "apo"
    rounds: int = 3
    beam_width: int = 2
    branch: int = 2
    train_batch: int = 8
    examples: int = 4  # attempts shown to the critic
    temperature: float = 1.0
    max_tokens: int = 1024
    rollout_timeout: float | None = None  # each rollout's timeout_seconds
    wait_seconds: float = 1800.0  # how long a batch of rollouts may take
    seed: int = 0
    worker_id: str = field(default_factory=lambda: f"apo-{socket.gethostname()}-{os.getpid()}")


@dataclass(frozen=True)
class RoundReport:
    round: int
    best: Candidate
    candidates: list[Candidate]  # made this round (rejected ones too)
    published: str | None  # the resources id published, when the best changed


class Apo:
    def __init__(
        self,
        kafka: KafkaSettings,
        database: DatabaseSettings,
        config: ApoConfig,
        on_round: Callable[[RoundReport], None] | None = None,
        on_progress: Callable[[str, int, int], None] | None = None,
    ) -> None:
        if not config.val_tasks:
            raise ApoError("APO needs validation tasks to measure candidates on")
        if config.rounds > 0 and not config.train_tasks:
            raise ApoError("APO needs training tasks to critique templates on")
        self.kafka = kafka
        self.database = database
        self.config = config
        self.on_round = on_round
        self.on_progress = on_progress  # (what, rollouts finished, of how many)
        self.path = checkpoint_root(config.state_dir) / STATE_FILE
        self.state: ApoState | None = None
        self._publisher: EventPublisher | None = None
        self._resources: ResourcesPublisher | None = None
        self._model: ReadModel | None = None
        self._client: Any = None
        self.counts: Counter[str] = Counter()
        self.metrics = WorkerMetrics("apo", self._counts)
        self._round_span: Span | None = None  # the round running, for its children

    # -- the loop ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> ApoState:
        import openai

        await ensure_topics_ready(self.kafka, ("tasks", "resources"))
        cfg = self.config
        async with (
            producer(self.kafka) as prod,
            ResourcesPublisher(self.kafka, cfg.worker_id) as resources,
            ReadModel.open(self.database) as model,
            openai.AsyncOpenAI(
                base_url=cfg.optimizer_endpoint, api_key=cfg.optimizer_api_key, timeout=300
            ) as client,
        ):
            self._publisher = EventPublisher(prod, Topics(self.kafka))
            self._resources = resources
            self._model, self._client = model, client
            state = self.state = await self._load_or_start()
            best = state.best()
            if best is not None and best.score is not None:  # resumed
                self._best_score(best.score)
            await self._republish(state)
            while not stop.is_set() and state.round <= cfg.rounds:
                await self._round(state, stop)
        return state

    async def _round(self, state: ApoState, stop: asyncio.Event) -> None:
        began = time.monotonic()
        attributes: Attributes = {"agl.apo.run_id": state.run_id, "agl.apo.round": state.round}
        with self.metrics.tracer.span("apo.round", attributes=attributes) as span:
            self._round_span = span
            report = await self._run_round(state, stop)
            if report is None:
                span.set_attribute("agl.apo.stopped", True)
                return  # the next start goes on from the state file
            span.set_attributes({
                "agl.apo.best": report.best.cid, "agl.apo.best_score": report.best.score or 0.0,
                "agl.apo.candidates": len(report.candidates),
                "agl.apo.rejected": sum(1 for c in report.candidates if c.rejected),
                "agl.apo.published": report.published or "",
            })  # fmt: skip
        self.counts["rounds"] += 1
        self.metrics.observe(
            "round", time.monotonic() - began,
            "A round: its rollouts, critiques, rewrites and measuring.",
        )  # fmt: skip
        if self.on_round is not None:
            self.on_round(report)

    async def _run_round(self, state: ApoState, stop: asyncio.Event) -> RoundReport | None:
        made: list[Candidate] = []
        if state.round == 0:
            made = [state.candidates["c0"]]
        else:
            for parent in list(state.beam):
                if stop.is_set():
                    return None
                made += await self._branch(state, parent)
        valid = [c for c in made if c.rejected is None]
        for candidate in valid:
            await self._publish_candidate(state, candidate)
        for candidate in valid:
            if stop.is_set():
                return None
            await self._measure(state, candidate)
        state.beam = select_beam(
            [state.candidates[c] for c in state.beam] + valid, self.config.beam_width
        )
        best = state.best()
        if best is None:
            raise ApoError("no candidate could be measured")
        self._best_score(best.score or 0.0)
        published = None
        if not state.published or state.published[-1].cid != best.cid:
            published = await self._publish_best(state, best)
        state.history.append({
            "round": state.round, "best": best.cid, "best_score": best.score,
            "beam": list(state.beam), "made": [c.cid for c in made],
            "rejected": sum(1 for c in made if c.rejected), "published": published,
        })  # fmt: skip
        state.round += 1
        self._save(state)
        return RoundReport(state.round - 1, best, made, published)

    def _best_score(self, score: float) -> None:
        self.metrics.set(
            "best_score", score, "The best mean validation reward of the run's candidates."
        )

    def _counts(self) -> dict[str, float]:
        """What the metrics count, with the round the run is at."""
        return {**self.counts, "round": self.state.round if self.state is not None else 0}

    # -- one parent's children ----------------------------------------------------------------

    async def _branch(self, state: ApoState, parent_id: str) -> list[Candidate]:
        cfg = self.config
        parent = state.candidates[parent_id]
        key = f"{state.round}:{parent_id}"
        if key not in state.critiques:
            indexes = sample_tasks(
                len(cfg.train_tasks), cfg.train_batch, cfg.seed, state.round, parent_id
            )
            batch = f"r{state.round}-{parent_id}-train"
            tasks = [cfg.train_tasks[i] for i in indexes]
            rollouts = await self._run_batch(state, batch, tasks, parent, RolloutMode.TRAIN)
            examples = await self._examples(rollouts)
            answer = await self._ask(
                critique_messages(parent.template, examples), seed=None, kind="critique"
            )
            state.critiques[key] = answer
            self._save(state)
        critique = state.critiques[key]
        children = state.children(state.round, parent_id)
        names = PromptTemplate(template=parent.template, engine=state.engine).placeholders()
        for variant in range(len(children), cfg.branch):
            answer = await self._ask(
                rewrite_messages(parent.template, critique, names, variant, cfg.branch),
                seed=cfg.seed * 1000 + variant,
                kind="rewrite",
            )
            text = read_candidate(answer)
            reason = check_candidate(text, parent.template, state.engine, state.templates())
            child = state.add_candidate(text, parent_id, reason)
            if reason:
                self.counts["candidates_rejected"] += 1
                log.warning("round %d: rewrite %s of %s rejected: %s",
                            state.round, child.cid, parent_id, reason)  # fmt: skip
            self._save(state)
            children.append(child)
        return children

    async def _ask(self, messages: list[dict[str, str]], seed: int | None, kind: str) -> str:
        import openai

        cfg = self.config
        options: dict[str, Any] = {"temperature": cfg.temperature, "max_tokens": cfg.max_tokens}
        if seed is not None:
            options["seed"] = seed
        model = (cfg.critique_model if kind == "critique" else None) or cfg.optimizer_model
        began = time.monotonic()
        attributes = {"agl.apo.call": kind, "gen_ai.request.model": model}
        try:
            with self.metrics.tracer.span("apo.optimizer_call", self._round_span, attributes):
                reply = await self._client.chat.completions.create(
                    model=model, messages=messages, **options
                )
        except openai.APIError as exc:
            raise ApoError(f"the optimizer LLM at {cfg.optimizer_endpoint} failed: {exc}") from None
        finally:
            self.metrics.observe(
                "optimizer_call", time.monotonic() - began,
                "A critique or rewrite asked of the optimizer LLM.",
            )  # fmt: skip
        if not reply.choices:
            raise ApoError(f"the optimizer LLM at {cfg.optimizer_endpoint} gave no answer")
        return str(reply.choices[0].message.content or "")

    async def _examples(self, rollouts: list[Rollout]) -> list[Example]:
        assert self._model is not None
        by_id = {r.rollout_id: r for r in rollouts}
        chosen = worst([(r.rollout_id, r.reward) for r in rollouts], self.config.examples)
        # A rollout is finished before the projector may have all its spans (another topic).
        await self._caught_up("spans")
        examples = []
        for rollout_id in chosen:
            rollout = by_id[rollout_id]
            spans = await self._model.spans(
                rollout_id, latest_attempt=True, name=LLM_CALL_SPAN, limit=1000
            )
            calls = [s for s in spans if s.status_code != "error"]
            calls.sort(key=lambda s: (s.end_time, s.sequence))
            error = (rollout.error or {}).get("message")
            messages = tuple(call_messages(s.attributes for s in calls))
            examples.append(Example(rollout.input, messages, rollout.reward, error))
        return examples

    # -- measuring ----------------------------------------------------------------------------

    async def _measure(self, state: ApoState, candidate: Candidate) -> None:
        if candidate.rewards is not None:
            return
        batch = f"{candidate.cid}-val"
        rollouts = await self._run_batch(
            state, batch, list(self.config.val_tasks), candidate, RolloutMode.VAL
        )
        candidate.rewards = [r.reward if r.status == "succeeded" else None for r in rollouts]
        self._save(state)
        self.counts["candidates_evaluated"] += 1
        log.info("%s: score %.4f over %d rollouts", candidate.cid, candidate.score or 0.0,
                 len(rollouts))  # fmt: skip

    async def _run_batch(
        self,
        state: ApoState,
        batch: str,
        tasks: list[Any],
        candidate: Candidate,
        mode: RolloutMode,
    ) -> list[Rollout]:
        """Run `tasks` pinned to the candidate's version; their rollouts once all finished."""
        began = time.monotonic()
        attributes = {"agl.apo.batch": batch, "agl.apo.candidate": candidate.cid,
                      "agl.mode": mode.value, "agl.apo.rollouts": len(tasks)}  # fmt: skip
        with self.metrics.tracer.span("apo.batch", self._round_span, attributes) as span:
            rollouts = await self._queue_and_wait(state, batch, tasks, candidate, mode)
            statuses = Counter(r.status for r in rollouts)
            span.set_attributes({f"agl.apo.rollouts.{k}": v for k, v in statuses.items()})
        self.counts.update({f"rollouts_{k}": v for k, v in statuses.items()})
        self.metrics.observe(
            "batch", time.monotonic() - began,
            "A batch of rollouts, from queueing until all ended and were read.",
        )  # fmt: skip
        return rollouts

    async def _queue_and_wait(
        self,
        state: ApoState,
        batch: str,
        tasks: list[Any],
        candidate: Candidate,
        mode: RolloutMode,
    ) -> list[Rollout]:
        assert self._model is not None
        assert self._publisher is not None
        ids = [f"{state.run_id}-{batch}-{i}" for i in range(len(tasks))]
        if state.batches.get(batch) != "queued":
            present = set()
            if batch in state.batches:  # killed while queuing: some may be on the topic
                present = await self._queued(state.run_id, batch)
            state.batches[batch] = "queuing"
            self._save(state)
            options = RolloutOptions(
                mode=mode, resources_id=candidate.resources_id,
                timeout_seconds=self.config.rollout_timeout,
                metadata={"apo_run": state.run_id, "apo_batch": batch},
            )  # fmt: skip
            events = [
                make_rollout(task, options, rollout_id)
                for rollout_id, task in zip(ids, tasks, strict=True)
                if rollout_id not in present
            ]
            await self._publisher.publish_many("tasks", events)
            self.counts["queued"] += len(events)
            state.batches[batch] = "queued"
            self._save(state)
        what = f"round {state.round}: {candidate.cid} on {len(ids)} {mode.value} tasks"

        def progress(finished: int, total: int) -> None:
            if self.on_progress is not None:
                self.on_progress(what, finished, total)

        await self._model.wait_for_rollouts(ids, self.config.wait_seconds, progress)
        found = {r.rollout_id: r for r in await self._batch_rollouts(state.run_id, batch)}
        return [found[i] for i in ids]

    async def _queued(self, run_id: str, batch: str) -> set[str]:
        """Rollouts of a batch already on the tasks topic, as the read model tells once it
        holds everything the topic holds now."""
        await self._caught_up("tasks")
        return {r.rollout_id for r in await self._batch_rollouts(run_id, batch)}

    async def _caught_up(self, short_topic: str) -> None:
        """Wait until the read model holds every record on the topic now."""
        assert self._model is not None
        topics = Topics(self.kafka)
        partitions = range(topics.specs[short_topic].partitions)
        tps = [TopicPartition(topics.name(short_topic), p) for p in partitions]
        ends = await end_offsets(self.kafka, tps)
        last = {tp: end - 1 for tp, end in ends.items() if end > 0}
        await self._model.wait_for_offsets(last, within=self.config.wait_seconds)

    async def _batch_rollouts(self, run_id: str, batch: str) -> list[Rollout]:
        assert self._model is not None
        rollouts: list[Rollout] = []
        cursor = None
        while True:
            page = await self._model.rollouts(
                metadata={"apo_run": run_id, "apo_batch": batch}, limit=1000, cursor=cursor
            )
            rollouts += page.items
            cursor = page.next_cursor
            if cursor is None:
                return rollouts

    # -- resources ----------------------------------------------------------------------------

    def _prompt(self, state: ApoState, template: str) -> dict[str, Any]:
        """What APO sets in a version: its prompt (JSON). The other resources (the policy,
        an endpoint) are the latest version's when it is published (resources.py)."""
        prompt = PromptTemplate(template=template, engine=state.engine)
        return {state.prompt_name: prompt.model_dump(mode="json")}

    async def _publish_candidate(self, state: ApoState, candidate: Candidate) -> None:
        parent = None if candidate.parent is None else state.candidates[candidate.parent]
        await self._send(
            candidate.resources_id, self._prompt(state, candidate.template),
            None if parent is None else parent.resources_id,
            {"apo_run": state.run_id, "candidate": candidate.cid, "round": str(candidate.round)},
            pin_only=True,
        )  # fmt: skip

    async def _publish_best(self, state: ApoState, best: Candidate) -> str:
        version = state.next_version  # APO's own count, for the id; the topic numbers it
        state.next_version = version + 1
        entry = Published(
            resources_id=f"{state.run_id}-v{version}", version=version, cid=best.cid,
            resources=self._prompt(state, best.template),
        )  # fmt: skip
        state.published.append(entry)
        self._save(state)
        await self._send_published(state, entry)
        self.counts["published"] += 1
        return entry.resources_id

    async def _send_published(self, state: ApoState, entry: Published) -> None:
        best = state.candidates[entry.cid]
        previous = state.published[-2].resources_id if len(state.published) > 1 else None
        await self._send(
            entry.resources_id, entry.resources, previous,
            {"apo_run": state.run_id, "candidate": best.cid, "round": str(best.round),
             "val_score": f"{best.score or 0.0:.6f}"},
        )  # fmt: skip

    async def _send(
        self,
        resources_id: str,
        resources: dict[str, Any],
        parent: str | None,
        metadata: dict[str, str],
        pin_only: bool = False,
    ) -> None:
        """Publish (or find published: the same id and prompt after a restart)."""
        assert self._resources is not None
        await self._resources.publish(Change(
            resources={k: PromptTemplate.model_validate(v) for k, v in resources.items()},
            resources_id=resources_id, pin_only=pin_only, parent_resources_id=parent,
            metadata={"algorithm": "apo", **metadata},
        ))  # fmt: skip

    async def _republish(self, state: ApoState) -> None:
        """After a restart: the last best version may have been cut off between the state
        write and the send, so it goes out again (found published if it was). Candidates are
        published again by the round that runs them."""
        if state.published:
            await self._send_published(state, state.published[-1])

    # -- state ------------------------------------------------------------------------------

    async def _load_or_start(self) -> ApoState:
        cfg = self.config
        digest = tasks_digest(cfg.train_tasks, cfg.val_tasks)
        if self.path.is_file():
            state = ApoState.from_json(self.path.read_text())
            if state.tasks_digest and state.tasks_digest != digest:
                raise ApoError(
                    f"{self.path} is a run started with other training or validation tasks; "
                    "resume it with the same task files, or start over in a new --checkpoint-dir"
                )
            log.info("resumed %s at round %d", state.run_id, state.round)
            return state
        resources = await read_resources(self.kafka)
        latest = resources.latest
        template = cfg.seed_template
        engine = cfg.engine
        if template is None:
            seed = latest.resources.get(cfg.prompt_name) if latest is not None else None
            if not isinstance(seed, PromptTemplate):
                raise ApoError(
                    f"no seed template: the latest resources version has no prompt template "
                    f"named {cfg.prompt_name!r}; pass one (--prompt)"
                )
            template, engine = seed.template, seed.engine
        try:
            PromptTemplate(template=template, engine=engine).placeholders()
        except TemplateError as exc:
            raise ApoError(f"the seed template cannot be used: {exc}") from None
        state = ApoState(
            run_id=f"{cfg.run_name}-{uuid.uuid4().hex[:8]}", prompt_name=cfg.prompt_name,
            engine=engine.value, next_version=resources.top_version + 1,
            carried=_others(latest, cfg.prompt_name) if latest else {}, tasks_digest=digest,
        )  # fmt: skip
        state.add_candidate(template, None)
        self._save(state)
        return state

    def _save(self, state: ApoState) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(f".partial-{os.getpid()}")
        with partial.open("w") as out:
            out.write(state.to_json())
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, self.path)


def _others(version: ResourcesPublished, prompt_name: str) -> dict[str, Any]:
    """A version's resources other than the prompt APO improves (JSON), to carry along."""
    return {k: v.model_dump(mode="json") for k, v in version.resources.items() if k != prompt_name}


def read_state(state_dir: str) -> ApoState | None:
    path = checkpoint_root(state_dir) / STATE_FILE
    return ApoState.from_json(path.read_text()) if path.is_file() else None
