"""The vLLM engine: vLLM's OpenAI server in a child process, driven with token ids.

The policy server renders and tokenizes every prompt itself, as with the torch engine, and
sends the ids; vLLM answers with token ids and the logprobs of the distribution each token
was drawn from. So prompts, ids and logprobs mean the same whichever engine answers.

A published version is served without a restart: every checkpoint is checked first
(checks.py), then, under the gate that lets the calls in flight end first, the weights are
reloaded in place (pause, reload through the worker extension that re-ties the output
layer, reset the prefix cache, resume) or a LoRA adapter is loaded. A checkpoint refused,
or a reload that fails, leaves the version served before. A vLLM that dies is started again
on the version it served; the calls it had fail with EngineUnavailable (HTTP 503: retry).

Several policies can share one vLLM as LoRA adapters of one base: each is a lane (`lane()`),
with its own version served as an adapter named after the lane and the version; a call
names its lane. A lane's checkpoint must then be an adapter of the base the others use.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from agl_stream.events import Checkpoint
from agl_stream.serving.checks import (
    CPU_HEAD_SIZES,
    AdapterShape,
    CheckpointRefused,
    ModelShape,
    check_adapter,
    check_model,
)
from agl_stream.serving.engines import EngineError, EngineUnavailable, Job, Serving
from agl_stream.serving.vllm_process import (
    ENGINE_MODEL,
    LORA_RANKS,
    EngineStartFailed,
    VllmProcess,
    VllmSettings,
    cpu_build,
    lora_rank_for,
)
from agl_stream.training.checkpoints import checkpoint_root
from agl_stream.training.hf import quiet_transformers
from agl_stream.training.model import content_hash

log = logging.getLogger(__name__)
WATCH_SECONDS = 2.0  # how often an idle engine's /health is asked
HEALTH_TIMEOUT = 10.0
MERGED_PREFIX = "agl-merged-"  # + the server's process id + a random part
ONLY = ""  # the lane of an engine serving one policy


@dataclass(frozen=True)
class Served(Serving):
    """A version as vLLM serves it: the base model and, for an adapter, its name there."""

    base: ModelShape | None = None
    base_hash: str = ""
    adapter: AdapterShape | None = None
    model: str = ENGINE_MODEL  # the name requests use: the base's or the adapter's
    merged: Path | None = None  # the adapter merged into the base, as vLLM serves it


@dataclass(frozen=True)
class _Plan:
    """A checked checkpoint: what to serve it with."""

    base: ModelShape
    base_hash: str
    adapter: AdapterShape | None
    tokenizer: Any
    checkpoint: Checkpoint


class Gate:
    """Calls go through it together; a reload or restart goes through alone, once the calls
    in it have ended, and new calls wait for it. So one version answers a call throughout."""

    def __init__(self) -> None:
        self._calls = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._alone: asyncio.Event | None = None  # set when the one going alone is done

    @property
    def calls(self) -> int:
        return self._calls

    @asynccontextmanager
    async def call(self) -> AsyncIterator[None]:
        while self._alone is not None:
            await self._alone.wait()
        self._calls += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._calls -= 1
            if not self._calls:
                self._idle.set()

    @asynccontextmanager
    async def alone(self) -> AsyncIterator[None]:
        while self._alone is not None:
            await self._alone.wait()
        done = self._alone = asyncio.Event()
        try:
            await self._idle.wait()
            yield
        finally:
            self._alone = None
            done.set()


class VllmEngine:
    def __init__(self, settings: VllmSettings, head_sizes: frozenset[int] | None = None) -> None:
        self.settings = settings
        self.head_sizes = head_sizes if head_sizes is not None else (
            CPU_HEAD_SIZES if cpu_build() else None
        )  # fmt: skip
        self.process: VllmProcess | None = None
        self.lora_rank = 0  # of the running engine (0: LoRA off)
        self.gate = Gate()
        self.counts = {"answered": 0, "engine_failures": 0, "engine_restarts": 0}
        self._lanes: dict[str, Served] = {}  # lane -> the version it serves
        self._lane_names: set[str] = set()
        self._down: str | None = None
        self._suspect = asyncio.Event()  # a call failed: look at the engine now
        self._started = asyncio.Event()
        self._retired: set[VllmProcess] = set()  # stopped on purpose, not dead
        self._session: aiohttp.ClientSession | None = None

    @property
    def serving(self) -> Served | None:
        return self._lanes.get(ONLY)

    def served(self, lane: str) -> Served | None:
        return self._lanes.get(lane)

    def lane(self, name: str) -> VllmLane:
        """The engine as one policy of several sees it: an Engine whose versions are LoRA
        adapters of the base every lane shares, called by the lane's name."""
        if not name:
            raise ValueError("a lane needs a name (the policy it serves)")
        self._lane_names.add(name)
        self.settings = dataclasses.replace(self.settings, adapters=len(self._lane_names))
        return VllmLane(self, name)

    @property
    def down(self) -> str | None:
        return self._down

    @property
    def url(self) -> str | None:
        """vLLM's own address (benchmarks call it directly)."""
        return self.process.url if self.process else None

    def stats(self) -> Mapping[str, int | float]:
        return dict(self.counts)

    # -- loading ----------------------------------------------------------------------------

    async def load(self, resources_id: str, checkpoint: Checkpoint, lane: str = ONLY) -> None:
        lanes = dict(self._lanes)  # a snapshot: the check runs in a thread
        plan = await asyncio.to_thread(self._check, checkpoint, lane, lanes)
        async with self.gate.alone():
            await self._apply(resources_id, plan, lane)

    def _shared(self, lane: str, lanes: Mapping[str, Served] | None = None) -> Served | None:
        """What a lane's new version is checked against: its own version, else another
        lane's (several lanes share the base)."""
        lanes = self._lanes if lanes is None else lanes
        return lanes.get(lane) or next(iter(lanes.values()), None)

    def _check(self, checkpoint: Checkpoint, lane: str, lanes: Mapping[str, Served]) -> _Plan:
        """The checkpoint's files checked against the model served (in a thread: hashing)."""
        if checkpoint.format == "safetensors":
            base_dir, base_hash = _directory(checkpoint.uri), checkpoint.content_hash
            adapter_dir = None
        elif checkpoint.format == "peft":
            if not checkpoint.base_uri:
                raise CheckpointRefused(
                    f"adapter {checkpoint.uri} names no base model (base_uri is empty)"
                )
            base_dir, adapter_dir = _directory(checkpoint.base_uri), _directory(checkpoint.uri)
            base_hash = checkpoint.base_content_hash or _hash(base_dir)
        else:
            raise CheckpointRefused(
                f"checkpoint {checkpoint.uri} has format {checkpoint.format!r}; "
                "'safetensors' (a model) and 'peft' (a LoRA adapter) are served"
            )
        served = self._shared(lane, lanes)
        if lane != ONLY:
            _check_shared_base(lane, checkpoint, base_hash, lanes)
        if served is not None and served.base is not None and base_hash == served.base_hash:
            base = served.base  # the model served: checked when it was loaded
        else:
            base = check_model(
                base_dir, base_hash, served.base if served else None, self.head_sizes
            )
        adapter = None
        if adapter_dir is not None:
            adapter = check_adapter(adapter_dir, checkpoint.content_hash, base, LORA_RANKS[-1])
        tokenizer = _tokenizer(adapter_dir, base_dir)
        if len(tokenizer) > int(base.config.get("vocab_size") or len(tokenizer)):
            raise CheckpointRefused(
                f"the tokenizer of {checkpoint.uri} has {len(tokenizer)} tokens, more than "
                f"the model's {base.config.get('vocab_size')}"
            )
        return _Plan(base, base_hash, adapter, tokenizer, checkpoint)

    async def _apply(self, resources_id: str, plan: _Plan, lane: str = ONLY) -> None:
        if lane != ONLY:  # again, now that the lanes cannot change: two may have loaded at once
            _check_shared_base(lane, plan.checkpoint, plan.base_hash, self._lanes)
        before = self._lanes.get(lane)
        shared = self._shared(lane)  # the base the engine runs now
        merging = plan.adapter is not None and self.settings.merge_adapters and lane == ONLY
        rank = plan.adapter.rank if plan.adapter and not merging else 0
        restarted = False
        if self.process is None or (rank and lora_rank_for(rank) > self.lora_rank):
            # No engine yet, or one without room for this adapter: (re)started on the base,
            # with the other lanes' adapters put back.
            try:
                await self._start(plan.base, max(rank, self._lanes_rank(lane)))
                await self._put_back_lanes(but=lane)
            except (EngineStartFailed, EngineError) as exc:
                if shared is not None:
                    await self._restore()
                raise CheckpointRefused(
                    f"vLLM could not serve {plan.base.directory}: {exc}"
                ) from None
            restarted, self._down = True, None
        elif (shared is None or plan.base_hash != shared.base_hash) or (
            not merging and shared.merged is not None
        ):
            # A new base; or, from merged weights, the base itself (a merged version only
            # reloads what its adapter changes: see merge_adapter).
            try:
                await self._reload(plan.base.directory)
            except EngineError as exc:
                if shared is not None:
                    await self._restore()
                raise CheckpointRefused(
                    f"vLLM could not reload {plan.base.directory}: {exc}"
                ) from None
        context = await self._context()
        model, merged = ENGINE_MODEL, None
        if merging:
            assert plan.adapter is not None
            merged = await asyncio.to_thread(
                merge_adapter, plan.base.directory, plan.adapter,
                self.settings.dtype or plan.base.dtype,
            )  # fmt: skip
            try:
                await self._reload(merged)
            except EngineError as exc:
                shutil.rmtree(merged, ignore_errors=True)
                if before is not None:
                    await self._restore()
                raise CheckpointRefused(f"vLLM could not reload {merged}: {exc}") from None
        elif plan.adapter is not None:
            model = resources_id if lane == ONLY else f"{lane}@{resources_id}"
            try:
                await self._load_adapter(model, plan.adapter.directory)
            except CheckpointRefused:
                if restarted and before is not None:  # the new engine lacks the lane's own
                    try:
                        await self._put_back(before)
                    except EngineError:
                        await self._restore()
                raise
        self._lanes[lane] = Served(
            resources_id, plan.tokenizer, context, plan.base, plan.base_hash, plan.adapter, model,
            merged,
        )  # fmt: skip
        if before is not None and before.merged is not None and before.merged != merged:
            shutil.rmtree(before.merged, ignore_errors=True)
        if before is not None and before.adapter is not None and before.model != model:
            with contextlib.suppress(EngineError):  # only frees a slot
                await self._post("/v1/unload_lora_adapter", {"lora_name": before.model})

    async def _restore(self) -> None:
        """Back to the versions served before a failed reload (vLLM's own state may be
        broken by it: a new engine on the old weights)."""
        served = next(iter(self._lanes.values()))
        assert served.base is not None
        try:
            await self._start(served.base, self._lanes_rank())
            await self._put_back_lanes()
        except (EngineStartFailed, EngineError) as exc:
            self._down = f"the vLLM engine could not be started again: {exc}"
            if self.process is not None:  # not whole: the watcher starts it again
                old, self.process = self.process, None
                self._retired.add(old)
                await old.stop()
            self._suspect.set()

    def _lanes_rank(self, but: str | None = None) -> int:
        """The largest rank of the adapters the lanes serve (0: none), `but` one left out."""
        return max(
            (s.adapter.rank for lane, s in self._lanes.items()
             if lane != but and s.adapter is not None and s.merged is None),
            default=0,
        )  # fmt: skip

    async def _put_back_lanes(self, but: str | None = None) -> None:
        for lane, served in self._lanes.items():
            if lane != but:
                await self._put_back(served)

    async def _start(self, base: ModelShape, rank: int) -> None:
        if self.process is not None:
            old, self.process = self.process, None
            self._retired.add(old)
            await old.stop()
        rank = max(rank, self.settings.max_lora_rank)
        self.lora_rank = lora_rank_for(rank) if rank else 0
        log.info("starting vLLM on %s%s", base.directory, f" (LoRA rank {rank})" if rank else "")
        self.process = await VllmProcess.start(
            self.settings, base.directory, self.lora_rank, base.dtype
        )
        self._started.set()

    async def _reload(self, directory: Path) -> None:
        await self._post("/pause?mode=wait")
        try:
            await self._post(
                "/collective_rpc",
                {"method": "agl_reload_weights", "kwargs": {"weights_path": str(directory)}},
            )
            # Required: a prompt longer than a KV block is otherwise answered from the old
            # weights' cached prefix (test_vllm's long prompt). /pause clears the cache too in
            # vLLM 0.32, but that is deprecated there.
            await self._post("/reset_prefix_cache")
        finally:
            await self._post("/resume")

    async def _put_back(self, served: Served) -> None:
        """On a vLLM started anew on the base: the version's adapter, or its merged weights
        (EngineError when vLLM will not take them back: the engine is then not whole)."""
        if served.merged is not None:
            await self._reload(served.merged)
        elif served.adapter is not None:
            try:
                await self._load_adapter(served.model, served.adapter.directory)
            except CheckpointRefused as exc:
                raise EngineError(f"{served.model} could not be put back: {exc}") from None

    async def _load_adapter(self, name: str, directory: Path) -> None:
        try:
            body = {"lora_name": name, "lora_path": str(directory)}
            await self._post("/v1/load_lora_adapter", body)
        except EngineError as exc:
            raise CheckpointRefused(f"vLLM would not load adapter {directory}: {exc}") from None

    async def _context(self) -> int:
        async with self._http().get(f"{self._url()}/v1/models") as response:
            models = await response.json()
        return int(models["data"][0]["max_model_len"])

    # -- calls ------------------------------------------------------------------------------

    async def submit(self, job: Job, lane: str = ONLY) -> str:
        if self._down is not None:  # not queued behind a restart: the caller retries
            raise EngineUnavailable(self._down)
        async with self.gate.call():
            served = self._lanes.get(lane)
            if self._down is not None:
                raise EngineUnavailable(self._down)
            assert served is not None, "nothing is served yet"
            job.resources_id = served.resources_id
            body = {
                "model": served.model, "prompt": list(job.prompt_ids),
                "max_tokens": job.max_tokens, "temperature": job.temperature,
                "logprobs": 0, "return_token_ids": True, "stream": job.stream,
            }  # fmt: skip
            if job.seed is not None:
                body["seed"] = job.seed
            process = self.process
            try:
                async with self._http().post(f"{self._url()}/v1/completions", json=body) as answer:
                    if answer.status != 200:
                        raise _answered_error(answer.status, await answer.read())
                    if job.stream:
                        await _read_stream(answer, job)
                    else:
                        _read_whole(orjson.loads(await answer.read()), job)
            except (aiohttp.ClientError, TimeoutError, _Failed) as exc:
                raise await self._failed(process, exc) from None
        self.counts["answered"] += 1
        return served.resources_id

    async def _failed(self, process: VllmProcess | None, exc: Exception) -> EngineError:
        """What a failed call tells its caller: retry if the engine is gone."""
        self.counts["engine_failures"] += 1
        if isinstance(exc, _Failed) and exc.status < 500:
            return EngineError(f"vLLM refused the call: {exc}")
        if process is None or not await self._alive(process):
            self._suspect.set()
            return EngineUnavailable(
                f"the vLLM engine stopped during this call ({type(exc).__name__}: {exc}); "
                "it is being restarted: send the call again"
            )
        return EngineError(f"vLLM failed the call: {type(exc).__name__}: {exc}")

    # -- supervision ------------------------------------------------------------------------

    async def run(self) -> None:
        """Watch the engine; start it again, on the version it served, when it dies."""
        while True:
            await self._started.wait()
            process = self.process
            if process is None:  # a start failed
                if self._down is not None and self._lanes:  # and so did the restore: again
                    async with self.gate.alone():
                        if self.process is None and self._down is not None:
                            await self._recover()
                    continue
                await asyncio.sleep(WATCH_SECONDS)
                continue
            why = await self._watch(process)
            if process in self._retired:
                self._retired.discard(process)
                continue
            self._down = f"the vLLM engine stopped ({why}); it is being restarted"
            log.error("%s", self._down)
            await process.stop(grace=2.0)  # whatever is left of it: the calls to it fail now
            async with self.gate.alone():
                self.process = None
                await self._recover()

    async def _recover(self) -> None:
        served = next(iter(self._lanes.values()), None)
        delay = 1.0
        while served is not None and served.base is not None:
            try:
                await self._start(served.base, self.lora_rank)
                await self._put_back_lanes()
            except (EngineStartFailed, EngineError) as exc:
                log.error("the vLLM engine did not start again (%s); trying again", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
                continue
            break
        self.counts["engine_restarts"] += 1
        self._down = None
        serving = [served.resources_id for served in self._lanes.values()]
        log.info("the vLLM engine is back, serving %s", serving)

    async def _watch(self, process: VllmProcess) -> str:
        """Returns why `process` is taken for dead: it exited, or /health failed."""
        failed = timeouts = 0
        while True:
            self._suspect.clear()
            exited = asyncio.ensure_future(process.process.wait())
            suspect = asyncio.ensure_future(self._suspect.wait())
            try:
                await asyncio.wait(
                    {exited, suspect}, timeout=WATCH_SECONDS, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                exited.cancel()
                suspect.cancel()
            if process.process.returncode is not None:
                return f"exit status {process.process.returncode}"
            if self.process is not process:
                return "replaced"
            status = await self._health(process)
            failed = failed + 1 if status == "failed" else 0
            timeouts = timeouts + 1 if status == "timeout" else 0
            if failed >= 2:
                return "its /health answers with an error"
            if timeouts >= 3:
                return f"its /health did not answer for {3 * HEALTH_TIMEOUT:.0f} s"

    async def _health(self, process: VllmProcess) -> str:
        try:
            async with self._http().get(
                f"{process.url}/health", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT)
            ) as response:
                return "ok" if response.status == 200 else "failed"
        except TimeoutError:
            return "timeout"
        except aiohttp.ClientError:
            return "failed"

    async def _alive(self, process: VllmProcess) -> bool:
        if process.process.returncode is not None:
            return False
        return await self._health(process) == "ok"

    async def close(self) -> None:
        if self.process is not None:
            process, self.process = self.process, None
            await process.stop()
        if self._session is not None:
            await self._session.close()
        for served in self._lanes.values():
            if served.merged is not None:
                shutil.rmtree(served.merged, ignore_errors=True)

    # -- HTTP -------------------------------------------------------------------------------

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No total timeout: a long generation is not a failure. A dead engine is found
            # by the watcher, which stops the process and so every call to it.
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                connector=aiohttp.TCPConnector(limit=0),
            )
        return self._session

    def _url(self) -> str:
        if self.process is None:
            raise EngineUnavailable(self._down or "the vLLM engine is not running")
        return self.process.url

    async def _post(self, path: str, body: Mapping[str, Any] | None = None) -> None:
        try:
            async with self._http().post(f"{self._url()}{path}", json=body) as response:
                if response.status != 200:
                    raise _answered_error(response.status, await response.read())
        except _Failed as exc:
            raise EngineError(f"{path} answered {exc}") from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineError(f"{path} failed: {type(exc).__name__}: {exc}") from None


class VllmLane:
    """One policy of several served by one vLLM engine, as an Engine: its versions load as
    adapters beside the other lanes', its calls name its adapter. The engine's own work
    (run, close) is the engine's, done once by whoever holds it."""

    def __init__(self, engine: VllmEngine, name: str) -> None:
        self.engine = engine
        self.name = name

    @property
    def serving(self) -> Served | None:
        return self.engine.served(self.name)

    @property
    def down(self) -> str | None:
        return self.engine.down

    @property
    def url(self) -> str | None:
        return self.engine.url

    def stats(self) -> Mapping[str, int | float]:
        return self.engine.stats()

    async def load(self, resources_id: str, checkpoint: Checkpoint) -> None:
        await self.engine.load(resources_id, checkpoint, self.name)

    async def submit(self, job: Job) -> str:
        return await self.engine.submit(job, self.name)

    async def run(self) -> None:
        await asyncio.Event().wait()  # the engine runs once, not once per lane

    async def close(self) -> None:
        pass


def _check_shared_base(
    lane: str, checkpoint: Checkpoint, base_hash: str, lanes: Mapping[str, Served]
) -> None:
    """A lane of several serves LoRA adapters of the base the other lanes use."""
    if checkpoint.format != "peft":
        raise CheckpointRefused(
            f"policy {lane!r}: {checkpoint.uri} is a whole model; policies that share one "
            "vLLM are LoRA adapters of one base (serve a whole-model policy with a serve "
            "of its own)"
        )
    for other, served in lanes.items():
        if other != lane and served.base_hash != base_hash:
            theirs = served.base.directory if served.base else served.base_hash
            raise CheckpointRefused(
                f"policy {lane!r}: the adapter {checkpoint.uri} is of another base "
                f"({checkpoint.base_uri}) than policy {other!r}'s ({theirs}); policies that "
                "share one vLLM share its base"
            )


class _Failed(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


def _answered_error(status: int, raw: bytes) -> _Failed:
    try:
        body = json.loads(raw)
        message = body.get("error", {}).get("message") or body.get("message") or body
    except (ValueError, AttributeError):
        message = raw[:500].decode(errors="replace")
    return _Failed(status, str(message))


def _read_whole(body: Mapping[str, Any], job: Job) -> None:
    choice = body["choices"][0]
    ids = [int(t) for t in choice["token_ids"]]
    logprobs = [float(p) for p in choice["logprobs"]["token_logprobs"]]
    for token, logprob in zip(ids, logprobs, strict=True):
        job.token_ids.append(token)
        job.logprobs.append(logprob)
        job.on_token(token, logprob)
    job.finish_reason = _finish(choice)


async def _read_stream(answer: aiohttp.ClientResponse, job: Job) -> None:
    """Server-sent chunks: each carries new token ids and their logprobs."""
    buffer = b""
    async for data in answer.content.iter_any():
        buffer += data
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            payload = event.removeprefix(b"data: ").strip()
            if not payload or payload == b"[DONE]":
                continue
            chunk = orjson.loads(payload)
            if "error" in chunk:
                raise _Failed(500, str(chunk["error"]))
            choice = chunk["choices"][0]
            ids = choice.get("token_ids") or []
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
            for token, logprob in zip(ids, logprobs, strict=True):
                job.token_ids.append(int(token))
                job.logprobs.append(float(logprob))
                job.on_token(int(token), float(logprob))
            if choice.get("finish_reason"):
                job.finish_reason = _finish(choice)


def _finish(choice: Mapping[str, Any]) -> str:
    # vLLM says "stop" for EOS as the torch engine does, "length" at the token limit.
    return str(choice.get("finish_reason") or "length")


def merge_adapter(base_dir: Path, adapter: AdapterShape, dtype: str | None = None) -> Path:
    """The base with the adapter merged into it, in a temporary directory that vLLM reloads
    in place (in memory where /dev/shm is). An adapter of linear layers gives only the
    weights it changes (lora.merged_linear_weights, in the engine's `dtype`): vLLM's reload
    leaves every other weight as it is, which is the base's, since each merged version is
    reloaded onto an engine serving its base or another version of it. Any other adapter is
    merged by peft and saved whole (tied embeddings stay tied: the worker re-ties)."""
    from agl_stream.training.lora import merged, merged_linear_weights
    from agl_stream.training.model import load_policy, save_policy

    memory = Path("/dev/shm")
    place = memory if memory.is_dir() else Path(tempfile.gettempdir())
    remove_orphans(place)
    target = Path(tempfile.mkdtemp(prefix=f"{MERGED_PREFIX}{os.getpid()}-", dir=place))
    try:
        weights = merged_linear_weights(base_dir, adapter.directory, _torch_dtype(dtype))
        if weights is not None:
            from safetensors.torch import save_file

            save_file(weights, str(target / "model.safetensors"))
        else:
            save_policy(merged(load_policy(base_dir), adapter.directory), target)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    return target


def remove_orphans(place: Path) -> list[Path]:
    """Removes the merged weights that servers no longer running left in `place` (a server
    killed with -9 cannot remove its own: each is a whole model, in memory under /dev/shm).
    A directory's name holds the process id of the server that made it."""
    removed = []
    for directory in place.glob(f"{MERGED_PREFIX}*-*"):
        owner = directory.name[len(MERGED_PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not _running(int(owner)):
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _torch_dtype(name: str | None) -> Any:
    """torch's dtype for vLLM's --dtype name (None: keep the checkpoint's)."""
    import torch

    known = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
             "float32": torch.float32, "float": torch.float32}  # fmt: skip
    return known.get(name or "")


def _directory(uri: str) -> Path:
    try:
        return checkpoint_root(uri)
    except ValueError as exc:
        raise CheckpointRefused(str(exc)) from None


def _hash(directory: Path) -> str:
    try:
        return content_hash(directory)
    except (ValueError, OSError) as exc:
        raise CheckpointRefused(str(exc)) from None


def _tokenizer(adapter_dir: Path | None, base_dir: Path) -> Any:
    for directory in (adapter_dir, base_dir):
        if directory is not None and (directory / "tokenizer_config.json").is_file():
            return _load_tokenizer(directory, _tokenizer_files(directory))
    raise CheckpointRefused(f"{base_dir} has no tokenizer (tokenizer_config.json)")


def _tokenizer_files(directory: Path) -> tuple[tuple[str, int, int], ...]:
    """The tokenizer's files as they are now (name, size, mtime): a version whose tokenizer
    did not change reuses the one loaded (a 49K-word tokenizer takes ~0.2 s to load)."""
    files = [
        p for p in sorted(directory.iterdir())
        if p.is_file() and (p.name.startswith(("tokenizer", "special_tokens")) or p.suffix in
                            {".model", ".tiktoken"} or p.name in {"vocab.json", "merges.txt"})
    ]  # fmt: skip
    return tuple((p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in files)


@functools.lru_cache(maxsize=4)
def _load_tokenizer(directory: Path, files: tuple[tuple[str, int, int], ...]) -> Any:
    del files  # the cache's key: the same directory with other files loads again
    quiet_transformers()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as exc:
        raise CheckpointRefused(f"the tokenizer in {directory} does not load: {exc}") from None
