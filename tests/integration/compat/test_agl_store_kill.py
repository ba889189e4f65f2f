"""`agl-stream store` killed with SIGKILL at random moments under load, many times, and started
again each time on the same topics and database. Four runners (dequeue, ask for span sequence
ids, add spans, finish the attempt) and an algorithm (enqueue) speak to it over HTTP with Agent
Lightning's LightningStoreClient. Some kills come after a quiet moment, so that the next store
starts at once and is killed while its projector still joins the consumer group: the start
after that waits longest for the read model. A call cut by a kill has an unknown outcome and
is not checked; every call that was answered is, at the end (what it says of a rollout also
right after each restart, before the load goes on):

- each enqueued rollout exists, with the values it was answered with;
- each rollout a dequeue answered with is out of the queue on the attempt it was handed out
  with; each finished attempt has its status, its rollout too; each added span is there with
  its values;
- no rollout is handed out twice, and none has a second attempt: their config has no retries
  and nothing times out, so a second hand-out is always a bug (a forgotten claim);
- a rollout's span sequence ids never repeat and only grow: the answers of
  get_next_span_sequence_id, get_many_span_sequence_ids and add_otel_span, and the spans stored.

Any other failure (an HTTP error status, a living store that does not answer, a span refused as
a duplicate, a store process that dies by itself) fails the test too.
Size: --store-kill-size ci (3 kills, the default) or long (49: make store-kill), then more
under load until one cut a call, and one with nothing in flight; the moments of the kills
come from --store-kill-seed."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest

from agl_stream.runtime.config import child_environment
from tests.integration.compat.test_agl_server import free_port
from tests.support import ROOT
from tests.support.agl_fixtures import Place, fresh_place, otel_span
from tests.support.backends import Backend
from tests.support.helpers import eventually, traversable
from tests.support.postgres_faults import KillablePostgres

from agentlightning.store.client_server import LightningStoreClient  # isort: skip
from agentlightning.types import (  # isort: skip  (after agl_stream.compat.agl)
    Attempt,
    AttemptedRollout,
    EnqueueRolloutRequest,
    OtelResource,
    Rollout,
    RolloutConfig,
    Span,
    TraceStatus,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

T = TypeVar("T")
HEALTH = "/v1/agl/health"
DEQUEUE = "/v1/agl/queues/rollouts/dequeue"
RUNNERS = 4
BACKLOG = 12  # the algorithm enqueues while fewer rollouts than this wait in the queue
NO_RETRIES = RolloutConfig(max_attempts=1, retry_condition=[])
CALL_SECONDS = 30.0  # a living store that answers no call in this long fails the test
# What an enqueue answers and the store must keep as it was (status and end_time move on).
ROLLOUT_FIELDS = ("input", "mode", "resources_id", "config", "metadata", "start_time")
# A span's times travel as nanoseconds (agl_stream/compat/agl/spans.py): a float of seconds may
# come back a unit in its last place away.
SPAN_FIELDS = ("sequence_id", "trace_id", "parent_id", "name", "attributes", "start_time",
               "end_time", "status")  # fmt: skip


@dataclass(frozen=True)
class KillSize:
    kills: int  # while the load runs; one more follows once it has stopped
    kill_after: tuple[float, float]  # seconds after a store process's first answer, uniformly
    # Every n-th kill comes after a quiet moment (the load paused, the projection caught up):
    # the next store then starts at once, and the kill after it finds its projector still
    # joining the consumer group, which the next start waits out (the most it waits is
    # it waits until the read model holds what the stores before it committed).
    quiet_every: int


SIZES = {
    "ci": KillSize(kills=3, kill_after=(0.0, 2.0), quiet_every=2),
    "long": KillSize(kills=49, kill_after=(0.0, 6.0), quiet_every=3),
}
QUIET_SECONDS = 2.0
EXTRA_KILLS = 5


@pytest.fixture
def store_kill_size(request: pytest.FixtureRequest) -> tuple[KillSize, int]:
    return (
        SIZES[str(request.config.getoption("--store-kill-size"))],
        int(request.config.getoption("--store-kill-seed")),
    )


# ---- the store processes --------------------------------------------------------------------


class StoreProcesses:
    """`agl-stream store` on one URL, one process at a time, each forked by
    tests/support/store_forker.py (which imports Agent Lightning once: a cold start of the
    store spends most of its 10 s there, and the test starts dozens)."""

    def __init__(self, forker: asyncio.subprocess.Process, url: str, logs: Path) -> None:
        self.forker = forker
        self.url = url
        self.logs = logs
        self.started = 0
        self.pid = 0
        self.restart_seconds: list[float] = []

    @classmethod
    @contextlib.asynccontextmanager
    async def forked(cls, place: Place, logs: Path) -> AsyncIterator[StoreProcesses]:
        url = f"http://127.0.0.1:{free_port()}"
        env = child_environment(place.kafka, place.database)
        env["AGENT_LIGHTNING_STORE_URL"] = url
        for name in ("AGL_SERVER_HOST", "AGL_SERVER_PORT"):
            env.pop(name, None)
        forker = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.support.store_forker", env=env, cwd=ROOT,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        stores = cls(forker, url, logs)
        try:
            yield stores
        finally:
            with contextlib.suppress(ProcessLookupError):
                if stores.pid:
                    os.killpg(stores.pid, signal.SIGKILL)
            assert forker.stdin is not None
            forker.stdin.close()
            await asyncio.wait_for(forker.wait(), 60)

    @property
    def log(self) -> Path:
        return self.logs / f"store-{self.started}.log"

    def tail(self) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return f"store process {self.started}'s log ends:\n{text[-3000:]}"

    async def ask(self, command: str) -> str:
        assert self.forker.stdin is not None and self.forker.stdout is not None
        self.forker.stdin.write(f"{command}\n".encode())
        await self.forker.stdin.drain()
        line = await asyncio.wait_for(self.forker.stdout.readline(), 180)  # its imports first
        assert line, f"the store forker ended (exit {await self.forker.wait()})"
        return line.decode().strip()

    async def start(self) -> None:
        """A new store process, returning once its health route answers."""
        self.started += 1
        self.pid = int((await self.ask(f"start {self.log}")).removeprefix("pid "))
        began = time.monotonic()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            while time.monotonic() - began < 120:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with http.get(self.url + HEALTH) as response:
                        if response.status == 200:
                            self.restart_seconds.append(time.monotonic() - began)
                            return
                state = await self.ask("poll")
                assert state == "running", f"it ended ({state}) before it served: {self.tail()}"
                await asyncio.sleep(0.1)
        raise AssertionError(f"the store was not healthy 120 s after it started: {self.tail()}")

    async def running(self) -> None:
        state = await self.ask("poll")
        assert state == "running", f"the store process died by itself ({state}): {self.tail()}"

    async def kill(self, ledger: Ledger) -> None:
        """SIGKILL the store process now (no await before it: what the ledger sees in flight
        is in flight when it dies), count the kill, and reap it."""
        ledger.kills += 1
        os.killpg(self.pid, signal.SIGKILL)
        ledger.up.clear()  # the load waits until the restart's checks are done
        state = await self.ask("reap")
        self.pid = 0
        assert state == f"exit {-signal.SIGKILL}", state


# ---- what the store answered ----------------------------------------------------------------


class Unanswered(Exception):
    """A call got no answer: its outcome is unknown (the ledger has recorded why)."""


@dataclass
class Ledger:
    """Every answer of the store, each with the number of kills before it (`kills`: the store
    process that answered)."""

    up: asyncio.Event = field(default_factory=asyncio.Event)
    kills: int = 0
    enqueued: dict[str, tuple[Rollout, int]] = field(default_factory=dict)
    claims: dict[str, list[tuple[str, str, int]]] = field(default_factory=dict)
    sequences: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    spans: list[tuple[Span, int]] = field(default_factory=list)
    finished: dict[str, tuple[str, str, int]] = field(default_factory=dict)
    answered: Counter[int] = field(default_factory=Counter)
    cut: Counter[str] = field(default_factory=Counter)
    in_flight: int = 0  # calls sent and not answered yet
    sending: asyncio.Event = field(default_factory=asyncio.Event)  # set while in_flight > 0
    problems: list[str] = field(default_factory=list)
    reported: set[str] = field(default_factory=set)  # what restarts' checks found
    # The rollouts enqueued and not handed out, as far as the answers tell (the algorithm
    # keeps the queue short by it); read again after each restart.
    queued: set[str] = field(default_factory=set)
    # While PostgreSQL is away, a call that needs the read model is answered 503 (try again):
    # an unknown outcome, like a cut call, counted here; any other error status is a problem.
    database_away: bool = False
    deferred: Counter[str] = field(default_factory=Counter)

    async def call(self, what: str, make: Callable[[], Awaitable[T]]) -> T:
        """The answer to a call made while a store process serves; Unanswered when a kill cut
        it (or the connection broke), or when it failed otherwise (recorded as a problem)."""
        await self.up.wait()
        kills = self.kills
        self.in_flight += 1
        self.sending.set()
        try:
            answer = await make()
        except aiohttp.ClientResponseError as exc:
            if exc.status == 503 and self.database_away:
                self.deferred[what] += 1
                await asyncio.sleep(0.2)
                raise Unanswered(what) from None
            self.problems.append(
                f"{what}: HTTP {exc.status} {exc.message}, before kill {kills + 1}"
            )
        except TimeoutError:
            if self.kills == kills:
                self.problems.append(f"{what}: no answer in {CALL_SECONDS:g} s from a living store")
            else:
                self.cut[what] += 1
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError):
            self.cut[what] += 1  # a store process that dies by itself fails the killer's poll
            await asyncio.sleep(0.05)
        else:
            self.answered[self.kills] += 1
            return answer
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self.sending.clear()
        raise Unanswered(what)

    async def calling(self) -> None:
        """Return (without a pause after) once a call is in flight."""
        async with asyncio.timeout(30):
            while not self.in_flight:
                await self.sending.wait()

    def claimed(self, rollouts: list[AttemptedRollout], by: str) -> None:
        for r in rollouts:
            self.claims.setdefault(r.rollout_id, []).append((r.attempt.attempt_id, by, self.kills))
            self.queued.discard(r.rollout_id)
            if r.status != "preparing" or r.attempt.sequence_id != 1 or r.attempt.worker_id != by:
                self.problems.append(
                    f"dequeue answered rollout {r.rollout_id} {r.status}, attempt "
                    f"{r.attempt.sequence_id} of worker {r.attempt.worker_id} (to {by})"
                )

    def report(self, found: list[tuple[str, str]], when: str) -> None:
        """The problems a restart's check found that no earlier restart's check reported (a
        lost write stays lost: one line, not one a restart). The final check reports all it
        finds, so a problem seen after a restart and still there at the end shows twice."""
        for what, problem in found:
            if what not in self.reported:
                self.problems.append(f"{problem} ({when})")
        self.reported.update(what for what, _ in found)

    def handed_out(self, rollout_id: str, sequence_ids: list[int]) -> None:
        self.sequences.setdefault(rollout_id, []).extend((s, self.kills) for s in sequence_ids)


async def dequeue(http: aiohttp.ClientSession, url: str, limit: int, worker: str) -> list[Any]:
    """Dequeue through the HTTP route itself: LightningStoreClient's dequeue answers an empty
    list for any error, and an error must not pass for an empty queue here."""
    body = {"limit": limit, "worker_id": worker}
    async with http.post(url + DEQUEUE, json=body) as response:
        response.raise_for_status()
        return [AttemptedRollout.model_validate(item) for item in await response.json()]


def client(url: str) -> LightningStoreClient:
    """One HTTP request a call: a retry after a kill would hide the cut call's outcome."""
    return LightningStoreClient(
        url, retry_delays=(), health_retry_delays=(), request_timeout=CALL_SECONDS
    )


# ---- the load -------------------------------------------------------------------------------


@dataclass
class Load:
    url: str
    ledger: Ledger
    seed: int
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def algorithm(self) -> None:
        rng = random.Random(f"{self.seed}-algorithm")
        store = client(self.url)
        task = 0
        try:
            while not self.stop.is_set():
                with contextlib.suppress(Unanswered):
                    await self._enqueue(store, rng, task)
                task += 4
                await asyncio.sleep(rng.uniform(0.0, 0.15))
        finally:
            await store.close()

    async def _enqueue(self, store: LightningStoreClient, rng: random.Random, task: int) -> None:
        if len(self.ledger.queued) >= BACKLOG:
            return
        asked = [
            EnqueueRolloutRequest(
                input={"task": task + i, "text": "x" * rng.randint(0, 40)},
                mode=rng.choice(("train", "val", "test", None)),
                config=NO_RETRIES,
                metadata={"task": task + i, "by": "algorithm"},
            )
            for i in range(rng.choice((1, 1, 2, 4)))
        ]
        if len(asked) == 1:
            (one,) = asked
            made = [
                await self.ledger.call(
                    "enqueue_rollout",
                    lambda: store.enqueue_rollout(
                        input=one.input, mode=one.mode, config=one.config, metadata=one.metadata
                    ),
                )
            ]
        else:
            made = list(
                await self.ledger.call(
                    "enqueue_many_rollouts", lambda: store.enqueue_many_rollouts(asked)
                )
            )
        for request, rollout in zip(asked, made, strict=True):
            self.ledger.enqueued[rollout.rollout_id] = (rollout, self.ledger.kills)
            self.ledger.queued.add(rollout.rollout_id)
            given = (request.input, request.mode, request.config, request.metadata)
            if (rollout.input, rollout.mode, rollout.config, rollout.metadata) != given:
                self.ledger.problems.append(f"enqueue answered {rollout!r} for {request!r}")

    async def runner(self, index: int) -> None:
        name = f"runner-{index}"
        rng = random.Random(f"{self.seed}-{name}")
        store = client(self.url)
        timeout = aiohttp.ClientTimeout(total=CALL_SECONDS)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as http:
                while not self.stop.is_set():
                    limit = rng.choice((1, 1, 1, 2, 3))
                    try:
                        claimed = await self.ledger.call(
                            "dequeue", functools.partial(dequeue, http, self.url, limit, name)
                        )
                    except Unanswered:
                        continue
                    self.ledger.claimed(claimed, name)
                    if not claimed:
                        await asyncio.sleep(0.1)
                    for rollout in claimed:
                        await self._run(store, rng, rollout, name)
        finally:
            await store.close()

    async def _run(
        self, store: LightningStoreClient, rng: random.Random, rollout: AttemptedRollout, by: str
    ) -> None:
        """What an agent's runner does with a rollout: spans, then the attempt's end (asked
        again after a cut, as a runner would)."""
        rid, aid = rollout.rollout_id, rollout.attempt.attempt_id
        for step in range(rng.randint(1, 4)):
            with contextlib.suppress(Unanswered):
                await self._span(store, rng, rid, aid, f"{by}-{step}")
            await asyncio.sleep(rng.uniform(0.0, 0.05))
        status = "failed" if rng.random() < 0.2 else "succeeded"
        for _ in range(3):
            with contextlib.suppress(Unanswered):
                attempt = await self.ledger.call(
                    "update_attempt", lambda: store.update_attempt(rid, aid, status=status)
                )
                self.ledger.finished[rid] = (aid, attempt.status, self.ledger.kills)
                if attempt.status != status or attempt.attempt_id != aid:
                    self.ledger.problems.append(f"update_attempt({status}) answered {attempt!r}")
                return

    async def _span(
        self, store: LightningStoreClient, rng: random.Random, rid: str, aid: str, name: str
    ) -> None:
        ledger = self.ledger
        draw = rng.random()
        if draw < 0.3:  # the sequence id and the span in one call (two requests)
            made = otel_span(name, step=name, draw=draw)
            added = await ledger.call("add_otel_span", lambda: store.add_otel_span(rid, aid, made))
            if added is not None:
                ledger.handed_out(rid, [added.sequence_id])
        else:
            if draw < 0.6:
                many = await ledger.call(
                    "get_many_span_sequence_ids",
                    lambda: store.get_many_span_sequence_ids([(rid, aid)] * rng.randint(2, 3)),
                )
                ids = list(many)
            else:
                ids = [
                    await ledger.call(
                        "get_next_span_sequence_id",
                        lambda: store.get_next_span_sequence_id(rid, aid),
                    )
                ]
            ledger.handed_out(rid, ids)
            # The first: ids handed out and never used must not come back after a restart.
            sent = span(rid, aid, ids[0], name, rng)
            added = await ledger.call("add_span", lambda: store.add_span(sent))
        if added is None:
            ledger.problems.append(f"a new span {name} of {rid} was refused as a duplicate")
        else:
            ledger.spans.append((added, ledger.kills))


def span(rid: str, aid: str, seq: int, name: str, rng: random.Random) -> Span:
    return Span(
        rollout_id=rid, attempt_id=aid, sequence_id=seq, trace_id=f"{rng.getrandbits(128):032x}",
        span_id=f"{rng.getrandbits(64):016x}", parent_id=None, name=name,
        status=TraceStatus(status_code="OK"),
        attributes={"agentlightning.reward.0.value": rng.random(), "step": name},
        events=[], links=[], start_time=time.time(), end_time=time.time() + 0.5, context=None,
        parent=None, resource=OtelResource(attributes={"service.name": "kill-test"}, schema_url=""),
    )  # fmt: skip


# ---- the checks (pure: the ledger against what the last store process reads) ----------------


def rollout_problems(
    ledger: Ledger, stored: dict[str, Rollout], drained: bool
) -> list[tuple[str, str]]:
    """(what, problem) for each answer about a rollout that the store does not hold (`what`:
    the kind of answer and the rollout; `drained`: the queue was emptied, so no rollout may
    be queuing)."""
    out = []
    for rid, (made, kills) in ledger.enqueued.items():
        found = stored.get(rid)
        given = f"rollout {rid}, enqueued before kill {kills + 1},"
        if found is None:
            out.append((f"enqueued {rid}", f"{given} is missing"))
            continue
        for name in ROLLOUT_FIELDS:
            now, then = getattr(found, name), getattr(made, name)
            if now != then:
                out.append((f"enqueued {rid}", f"{given} has {name} {now!r}, not {then!r}"))
    for rid, claims in ledger.claims.items():
        if len(claims) > 1:
            each = "; ".join(f"attempt {a} to {by} before kill {k + 1}" for a, by, k in claims)
            out.append(
                (f"twice {rid}", f"rollout {rid} was handed out {len(claims)} times: {each}")
            )
        aid, by, kills = claims[0]
        found = stored.get(rid)
        latest = found.attempt if isinstance(found, AttemptedRollout) else None
        given = f"rollout {rid}, handed out to {by} on attempt {aid} before kill {kills + 1},"
        if found is None:
            out.append((f"claimed {rid}", f"{given} is missing"))
        elif found.status in ("queuing", "requeuing") or latest is None:
            out.append((f"claimed {rid}", f"{given} is {found.status}, attempt {attempt(latest)}"))
        elif latest.attempt_id != aid:
            out.append((f"claimed {rid}", f"{given} has latest attempt {latest.attempt_id}"))
    for rid, found in stored.items():
        if drained and found.status == "queuing":
            out.append((f"queuing {rid}", f"rollout {rid} is still queuing after the drain"))
        if isinstance(found, AttemptedRollout) and found.attempt.sequence_id != 1:
            count = found.attempt.sequence_id
            out.append((f"attempts {rid}", f"rollout {rid} has {count} attempts, no retries"))
    for rid, (aid, status, kills) in ledger.finished.items():
        found = stored.get(rid)
        latest = found.attempt if isinstance(found, AttemptedRollout) else None
        kept = None if found is None or latest is None else (found.status, latest.attempt_id)
        if kept != (status, aid) or latest is None or latest.status != status:
            now = "missing" if found is None else f"{found.status}, attempt {attempt(latest)}"
            given = f"rollout {rid}'s attempt {aid}, {status} before kill {kills + 1},"
            out.append((f"finished {rid}", f"{given} is now {now}"))
    return out


def attempt(found: Attempt | None) -> str:
    return "none" if found is None else f"{found.attempt_id} ({found.status})"


def span_problems(ledger: Ledger, stored: dict[str, list[Span]]) -> list[str]:
    out = []
    found = {(s.rollout_id, s.attempt_id, s.span_id): s for kept in stored.values() for s in kept}
    for added, kills in ledger.spans:
        where = (
            f"span {added.span_id} (sequence id {added.sequence_id}) of rollout "
            f"{added.rollout_id}, added before kill {kills + 1}"
        )
        kept = found.get((added.rollout_id, added.attempt_id, added.span_id))
        if kept is None:
            out.append(f"{where}, is missing")
            continue
        for name in SPAN_FIELDS:
            now, then = getattr(kept, name), getattr(added, name)
            if now != then and not (name.endswith("_time") and abs(now - then) < 1e-6):
                out.append(f"{where}: {name} {now!r}, not {then!r}")
    for rid, kept in stored.items():
        for seq, count in Counter(s.sequence_id for s in kept).items():
            if count > 1:
                out.append(f"rollout {rid} keeps {count} spans with sequence id {seq}")
    return out


def sequence_problems(ledger: Ledger) -> list[str]:
    out = []
    for rid, answers in ledger.sequences.items():
        seen: set[int] = set()
        highest = 0
        for seq, kills in answers:
            if seq in seen:
                out.append(
                    f"rollout {rid} was handed sequence id {seq} again, before kill {kills + 1}"
                )
            elif seq <= highest:
                out.append(
                    f"rollout {rid} was handed sequence id {seq} after {highest} (before kill "
                    f"{kills + 1}): they must grow"
                )
            seen.add(seq)
            highest = max(highest, seq)
    return out


async def read_rollouts(url: str, ledger: Ledger) -> dict[str, Rollout]:
    """Every rollout the ledger names, as the store reads it now."""
    store = LightningStoreClient(url)
    try:
        ids = sorted(set(ledger.enqueued) | set(ledger.claims))
        stored: dict[str, Rollout] = {}
        for start in range(0, len(ids), 200):
            page = await store.query_rollouts(rollout_id_in=ids[start : start + 200])
            stored.update((r.rollout_id, r) for r in page)
        return stored
    finally:
        await store.close()


async def read_spans(url: str, ledger: Ledger) -> dict[str, list[Span]]:
    """The spans of every rollout the ledger saw spans or sequence ids of."""
    store = LightningStoreClient(url)
    gate = asyncio.Semaphore(4)

    async def spans_of(rid: str) -> tuple[str, list[Span]]:
        async with gate:
            return rid, list(await store.query_spans(rid))

    try:
        with_spans = sorted(set(ledger.sequences) | {s.rollout_id for s, _ in ledger.spans})
        return dict(await asyncio.gather(*(spans_of(rid) for rid in with_spans)))
    finally:
        await store.close()


# ---- the test -------------------------------------------------------------------------------


async def read_back(
    stores: StoreProcesses, ledger: Ledger
) -> tuple[dict[str, Rollout], dict[str, list[Span]]]:
    """Kill the store with nothing in flight and start another, which knows only what reached
    the topics and the read model; drain its queue and read every rollout and span answered
    about; then kill it too."""
    await stores.running()
    await stores.kill(ledger)
    await stores.start()
    timeout = aiohttp.ClientTimeout(total=CALL_SECONDS)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        while drained := await dequeue(http, stores.url, 10, "drain"):
            ledger.claimed(drained, "drain")
    stored = await read_rollouts(stores.url, ledger)
    spans = await read_spans(stores.url, ledger)
    await stores.running()
    await stores.kill(ledger)
    return stored, spans


async def serving(ledger: Ledger) -> None:
    """Until the store process answered a call (after a kill, its projector waits out the
    killed one's consumer-group session before anything is written: seconds)."""

    async def answered() -> bool:
        return ledger.answered[ledger.kills] > 0

    await eventually(answered, 120, f"store process {ledger.kills + 1} to answer a call")


async def kill_while_serving(
    stores: StoreProcesses,
    ledger: Ledger,
    after: float,
    quiet: bool,
    workers: list[asyncio.Task[None]],
) -> None:
    """SIGKILL the store process `after` seconds after its first answer, under load (while a
    call is in flight) or (`quiet`) once the calls in flight have ended and the load has
    paused a while; start the next, and before the load goes on, read every rollout answered
    about (later calls could hide a lost claim or status: a runner's span sets a requeued
    rollout running)."""
    await serving(ledger)
    await asyncio.sleep(after)
    for worker in workers:
        if worker.done():  # only by a fault of the test's own: raise it
            worker.result()
    if quiet:
        ledger.up.clear()
        await asyncio.sleep(QUIET_SECONDS)
    await stores.running()
    if not quiet:
        await ledger.calling()
    await stores.kill(ledger)
    await stores.start()
    stored = await read_rollouts(stores.url, ledger)
    ledger.report(rollout_problems(ledger, stored, drained=False), f"after kill {ledger.kills}")
    ledger.queued = {rid for rid, rollout in stored.items() if rollout.status == "queuing"}
    ledger.up.set()


async def test_a_store_killed_under_load_keeps_every_answer(
    embedded_backend: Backend, tmp_path: Path, store_kill_size: tuple[KillSize, int]
) -> None:
    size, seed = store_kill_size
    rng = random.Random(seed)
    ledger = Ledger()
    async with (
        fresh_place(embedded_backend) as place,
        StoreProcesses.forked(place, tmp_path) as stores,
    ):
        await stores.start()
        load = Load(stores.url, ledger, seed)
        ledger.up.set()
        workers = [asyncio.create_task(load.algorithm())]
        workers += [asyncio.create_task(load.runner(i)) for i in range(RUNNERS)]
        try:
            for i in range(1, size.kills + 1):
                after, quiet = rng.uniform(*size.kill_after), i % size.quiet_every == 0
                await kill_while_serving(stores, ledger, after, quiet, workers)
            # A call in flight may have been answered before the kill reached the store: a
            # few more kills under load until one cut a call.
            for _ in range(EXTRA_KILLS):
                if sum(ledger.cut.values()) > 0:
                    break
                await kill_while_serving(stores, ledger, 0.0, False, workers)
            await serving(ledger)
        finally:
            load.stop.set()  # the runners finish the rollouts they hold
            ledger.up.set()
            await asyncio.wait_for(asyncio.gather(*workers), 120)
        # One more kill with nothing in flight: every answer is read by a later process.
        stored, spans = await read_back(stores, ledger)

    at_end = [f"{p} (at the end)" for _, p in rollout_problems(ledger, stored, drained=True)]
    at_end += sequence_problems(ledger) + span_problems(ledger, spans)
    problems = at_end + ledger.problems  # what stays wrong first, then the answers and restarts
    summary = (
        f"seed {seed}: {ledger.kills} kills; {len(ledger.enqueued)} rollouts enqueued, "
        f"{len(ledger.claims)} handed out, {sum(map(len, ledger.sequences.values()))} sequence "
        f"ids, {len(ledger.spans)} spans, {len(ledger.finished)} attempts finished; calls cut "
        f"by a kill: {dict(ledger.cut)}; restarts took "
        + ", ".join(f"{s:.1f}" for s in stores.restart_seconds)
        + " s"
    )
    print(summary)
    assert not problems, (
        f"{len(at_end)} problems at the end, {len(ledger.problems)} in answers or right after "
        f"restarts ({summary}):\n" + "\n".join(problems[:60])
    )
    assert sum(ledger.cut.values()) > 0, f"no kill cut a call: {summary}"
    busy = len(ledger.spans) >= 20 and len(ledger.finished) >= 10
    assert busy, f"too little load to mean much: {summary}"


@dataclass(frozen=True)
class DatabaseFaults:
    kills: int
    down_seconds: float


DATABASE_FAULTS = {
    "ci": DatabaseFaults(kills=2, down_seconds=10),
    "long": DatabaseFaults(kills=10, down_seconds=120),
}


async def test_postgres_killed_and_down_under_the_store_keeps_every_answer(
    embedded_backend: Backend, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The same load and checks, with PostgreSQL (the store's own, private to this test)
    killed with SIGKILL several times and then down a while, instead of the store: the store
    process never exits, answers from its memory meanwhile (503 for what needs the read
    model), and a store started afterwards on the same topics and database, built from the
    read model alone, holds every answer."""
    faults = DATABASE_FAULTS[str(request.config.getoption("--faults-size"))]
    rng = random.Random(37)
    ledger = Ledger(database_away=True)
    pg = KillablePostgres(traversable(tmp_path / "pg"))
    pg.start()
    try:
        async with (
            fresh_place(embedded_backend, pg.settings) as place,
            StoreProcesses.forked(place, tmp_path) as stores,
        ):
            await stores.start()
            load = Load(stores.url, ledger, 37)
            ledger.up.set()
            workers = [asyncio.create_task(load.algorithm())]
            workers += [asyncio.create_task(load.runner(i)) for i in range(RUNNERS)]
            try:
                for _ in range(faults.kills):
                    await asyncio.sleep(rng.uniform(1.0, 3.0))
                    await pg.kill()
                    await asyncio.sleep(rng.uniform(0.0, 1.0))
                    await pg.restart()
                    assert await stores.ask("poll") == "running", stores.tail()
                await asyncio.sleep(2.0)
                await pg.kill()
                before = sum(ledger.answered.values())
                await asyncio.sleep(faults.down_seconds)
                while_down = sum(ledger.answered.values()) - before
                assert await stores.ask("poll") == "running", stores.tail()
                await pg.restart()
                await asyncio.sleep(3.0)
            finally:
                load.stop.set()
                await asyncio.wait_for(asyncio.gather(*workers), 120)
            # A new store process holds only what reached the read model: every answer.
            stored, spans = await read_back(stores, ledger)
    finally:
        await asyncio.to_thread(pg.stop)
    problems = [f"{p} (at the end)" for _, p in rollout_problems(ledger, stored, drained=True)]
    problems += sequence_problems(ledger) + span_problems(ledger, spans) + ledger.problems
    summary = (
        f"PostgreSQL killed {faults.kills} times, then down {faults.down_seconds:g} s: "
        f"{len(ledger.enqueued)} rollouts enqueued, {len(ledger.claims)} handed out, "
        f"{len(ledger.spans)} spans, {len(ledger.finished)} attempts finished; {while_down} "
        f"calls answered while it was down; answered 503: {dict(ledger.deferred)}"
    )
    print(summary)
    assert not problems, f"{len(problems)} problems ({summary}):\n" + "\n".join(problems[:60])
    assert while_down > 0, f"the store answered nothing while PostgreSQL was down: {summary}"
    assert len(ledger.spans) >= 20 and len(ledger.finished) >= 10, f"too little load: {summary}"
