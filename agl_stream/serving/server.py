"""`agl-stream serve`: a policy behind the OpenAI API, with token ids and logprobs in every
answer and the resources version that answered in `system_fingerprint` and a header. It
serves a fixed model, or follows the resources topic (the latest version, or a pinned one)
and reloads when a new checkpoint is published.

It serves one policy, or several (`policies`): each is a lane that follows the checkpoint
resource of its name and answers the calls whose `model` names it. With vLLM the lanes share
one engine (each policy a LoRA adapter of one base); with torch each has its own model."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from opentelemetry.trace import Status, StatusCode

from agl_stream.agent.llm import POLICY
from agl_stream.commands.resources import ResourceCache
from agl_stream.events import Checkpoint
from agl_stream.gateway.routes import RESOURCES_HEADER
from agl_stream.gateway.wire import BadRequest, CallKind, error_body, parse_request
from agl_stream.runtime import http_errors
from agl_stream.runtime.http import Listening, guarded_app
from agl_stream.serving.api import (
    Answered,
    Detokenizer,
    Generation,
    InvalidRequest,
    chunk_body,
    new_id,
    read_generation,
    render_prompt,
    response_body,
    token_texts,
)
from agl_stream.serving.engine import Loaded, TorchEngine
from agl_stream.serving.engines import Engine, EngineError, Job, Serving, SharedEngine
from agl_stream.telemetry.metrics import WorkerMetrics
from agl_stream.training.device import Placement

log = logging.getLogger(__name__)
ENDPOINTS = {"/v1/chat/completions": CallKind.CHAT, "/v1/completions": CallKind.COMPLETION}
# The largest legitimate call fills a long context: 128k tokens are about 0.5 MB as text, or
# about 1 MB as token ids in JSON. 4 MiB leaves room for long message lists; above it, a 413.
MAX_BODY = 4 * 1024 * 1024


@dataclass
class Lane:
    """One policy served: the model name its calls give, the checkpoint resource it follows,
    the engine that answers it, and the versions it refused (id: why)."""

    name: str
    resource: str
    engine: Engine
    refused: dict[str, str] = field(default_factory=dict)


class PolicyServer:
    def __init__(
        self,
        model_name: str = "policy",
        max_batch: int = 32,
        placement: Placement | None = None,
        engine: Engine | None = None,
        policies: Sequence[str] = (),
    ) -> None:
        self.model_name = model_name
        self.lanes: dict[str, Lane] = {}
        if engine is None and len(policies) > 1:  # torch: a model per policy
            self.engines: list[Engine] = [TorchEngine(max_batch, placement) for _ in policies]
            for name, own in zip(policies, self.engines, strict=True):
                self.lanes[name] = Lane(name, name, own)
        else:
            # The torch engine by default, loading checkpoints where `placement` says.
            own = engine if engine is not None else TorchEngine(max_batch, placement)
            self.engines = [own]
            if len(policies) > 1:
                if not isinstance(own, SharedEngine):
                    raise ValueError("several policies need an engine they share (vLLM), or none")
                for name in policies:
                    self.lanes[name] = Lane(name, name, own.lane(name))
            else:  # one policy: the engine as it is (one --policy: its resource and name)
                name = policies[0] if policies else model_name
                self.lanes[name] = Lane(name, name if policies else "policy", own)
        self.engine: Engine = self.engines[0]  # run and closed, with the others, by the server
        self.several = bool(policies)  # calls name their policy as their model
        self.reloads = 0
        self.cache: ResourceCache | None = None  # what follow() folds: versions by id
        self.catch_up_seconds = 10.0
        self._tasks: list[asyncio.Task[None]] = []
        self._listening: Listening | None = None
        self.url = ""
        self._moved = asyncio.Event()  # set (and replaced) by every load and refusal
        self.counts: Counter[str] = Counter()
        self.in_flight = 0  # calls the engine is generating
        self.metrics = WorkerMetrics("policy_server", lambda: {
            **self.counts, "reloads": self.reloads, **self._engine_stats(),
            "refused": sum(len(lane.refused) for lane in self.lanes.values()),
        })  # fmt: skip

    def _engine_stats(self) -> Counter[str]:
        stats: Counter[str] = Counter()
        for engine in self.engines:
            stats.update(engine.stats())
        return stats

    @property
    def _first(self) -> Lane:
        return next(iter(self.lanes.values()))

    @property
    def resource(self) -> str:
        return self._first.resource

    @property
    def refused(self) -> dict[str, str]:
        """Versions whose checkpoint would not load: why (one policy's; see lanes)."""
        return self._first.refused

    @property
    def serving(self) -> Serving | None:
        return self._first.engine.serving

    @property
    def resources_id(self) -> str | None:
        return _served_id(self._first)

    def load(self, loaded: Loaded) -> None:
        """Serve `loaded` (torch engine, one policy) from the next batch on."""
        assert isinstance(self.engine, TorchEngine), "load() puts a torch policy in place"
        assert not self.several, "load() serves one policy"
        first = self.engine.serving is None
        self.engine.put(loaded)
        self._loaded(loaded.resources_id, first)

    def _loaded(self, resources_id: str, first: bool) -> None:
        self.reloads += not first
        log.info("serving %s", resources_id)
        self._wake()

    def _wake(self) -> None:
        moved, self._moved = self._moved, asyncio.Event()
        moved.set()

    async def follow(
        self, cache: ResourceCache, resource: str | None = None, pin: str | None = None
    ) -> None:
        """Keep serving the pinned version's `resource` checkpoint, or the latest version's (a
        version without one leaves the served policy as it is); with several policies, each
        policy's checkpoint (a resource of its name). Every change is looked at, including
        those that land while a load runs."""
        self.cache = cache
        if resource is not None and not self.several:
            self._first.resource = resource
        if pin is not None:
            self.catch_up_seconds = 0.0  # pinned: that version answers everyone
        await asyncio.gather(*(self._follow(lane, cache, pin) for lane in self.lanes.values()))

    async def _follow(self, lane: Lane, cache: ResourceCache, pin: str | None) -> None:
        while True:
            version = cache.versions.get(pin) if pin else cache.latest
            checkpoint = version.resources.get(lane.resource) if version else None
            served = lane.engine.serving
            if (
                version is None
                or not isinstance(checkpoint, Checkpoint)
                or version.resources_id in {_served_id(lane), *lane.refused}
                or (self.several and served is not None
                    and _same_checkpoint(cache, served, lane, checkpoint))
            ):  # fmt: skip
                await cache.changed()
                continue
            attributes: dict[str, str | int] = {
                "agl.resources_id": version.resources_id, "agl.version": version.version,
            }  # fmt: skip
            if self.several:
                attributes[POLICY] = lane.name
            with self.metrics.tracer.span("policy_server.reload", attributes=attributes) as span:
                try:
                    began = time.monotonic()
                    first = served is None
                    await lane.engine.load(version.resources_id, checkpoint)
                    self._loaded(version.resources_id, first)
                    self.metrics.observe(
                        "reload", time.monotonic() - began, "Loading a published checkpoint."
                    )
                    if not self.several:
                        self.metrics.set(
                            "version", version.version, "The resources version served."
                        )
                except (ValueError, OSError) as exc:
                    lane.refused[version.resources_id] = str(exc)
                    log.error("cannot load %s for %s: %s", version.resources_id, lane.name, exc)
                    span.set_status(Status(StatusCode.ERROR, f"refused: {exc}"[:500]))
                    self._wake()

    async def _catch_up(self, wanted: str | None, lane: Lane) -> None:
        """A caller that ran on a version newer than the one served (the gateway says which
        its attempt has) waits, briefly, for the reload, so on-policy stays on-policy.
        Older versions are answered by the current one; the answer says which."""
        if wanted is None or self.cache is None:
            return
        if not self._behind(wanted, lane):
            return
        self.counts["catch_up_waits"] += 1
        loop = asyncio.get_running_loop()
        began = loop.time()
        deadline = began + self.catch_up_seconds
        # Two things move the condition (the resources fold and a load): woken by either.
        while self._behind(wanted, lane) and (remaining := deadline - loop.time()) > 0:
            waits = [asyncio.ensure_future(self.cache.next_change().wait()),
                     asyncio.ensure_future(self._moved.wait())]  # fmt: skip
            try:
                await asyncio.wait(waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiting in waits:
                    waiting.cancel()
        self.metrics.observe(
            "catch_up", loop.time() - began, "A call's wait for a newer version to load."
        )

    def _behind(self, wanted: str, lane: Lane) -> bool:
        assert self.cache is not None
        served = lane.engine.serving
        served_id = _served_id(lane)
        if wanted == served_id or wanted in lane.refused:
            return False
        target = self.cache.versions.get(wanted)
        current = self.cache.versions.get(served_id or "")
        if target is None:
            return True  # not folded yet: the runner saw it, so it is on its way
        checkpoint = target.resources.get(lane.resource)
        if not isinstance(checkpoint, Checkpoint):
            return False  # a version that changed other resources: the policy is the same
        if self.several and served and _same_checkpoint(self.cache, served, lane, checkpoint):
            return False  # another policy's version: this one's checkpoint is the one served
        return current is None or target.version > current.version

    async def start(self, host: str, port: int, token: str | None = None) -> str:
        """Listen on host:port; with a `token`, every call but /health needs it (/metrics too)."""
        app = guarded_app(MAX_BODY, token)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self.metrics.respond)
        self._tasks.extend(asyncio.create_task(engine.run()) for engine in self.engines)
        self._listening = await Listening.start(app, host, port)
        self.url = self._listening.url
        return self.url

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._listening is not None:
            await self._listening.stop()
        for engine in self.engines:
            await engine.close()

    # -- handlers ---------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        models = [{"id": name, "object": "model", "owned_by": "agl-stream"}
                  for name in self.lanes]  # fmt: skip
        return web.json_response({"object": "list", "data": models})

    async def _health(self, request: web.Request) -> web.Response:
        """200 while every policy has a version served and the engine answers; what it
        serves, what it refused and why, and the engine's counters (its restarts, say)."""
        stats = self._engine_stats()
        down = next((engine.down for engine in self.engines if engine.down), None)
        body: dict[str, Any] = {
            "resources_id": self.resources_id, "reloads": self.reloads, **stats,
            "refused": self.refused, "engine_down": down,
            "engine_url": self.engine.url, "in_flight": self.in_flight,
        }  # fmt: skip
        if self.several:
            body["resources_id"] = None
            body["refused"] = {}
            body["policies"] = {
                lane.name: {"resources_id": _served_id(lane), "refused": lane.refused}
                for lane in self.lanes.values()
            }  # fmt: skip
        ok = all(lane.engine.serving for lane in self.lanes.values()) and down is None
        return web.json_response(body, status=200 if ok else 503)

    def _lane(self, model: object) -> Lane | None:
        """The policy a call asks for: with several, the one its `model` names."""
        if not self.several:
            return self._first
        return self.lanes.get(model) if isinstance(model, str) else None

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        kind = ENDPOINTS[request.path]
        try:
            body = parse_request(await request.read())
        except BadRequest as exc:
            return _error(400, str(exc), "invalid_request_error")
        lane = self._lane(body.get("model"))
        if lane is None:
            message = (
                f"the model {body.get('model')!r} is not served here; the policies served "
                f"are {', '.join(sorted(self.lanes))}"
            )
            return _error(404, message, "model_not_found")
        await self._catch_up(request.headers.get(RESOURCES_HEADER), lane)
        serving = lane.engine.serving
        if serving is None:
            return _error(503, "no policy version has been published yet", "not_ready")
        tokenizer, context = serving.tokenizer, serving.context
        try:
            generation = read_generation(kind, body, context)
            text = render_prompt(tokenizer, generation)
        except (BadRequest, InvalidRequest) as exc:
            return _error(400, str(exc), "invalid_request_error")
        prompt_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if not prompt_ids:
            return _error(400, "the prompt is empty", "invalid_request_error")
        if len(prompt_ids) + generation.max_tokens > context:
            message = (
                f"the prompt ({len(prompt_ids)} tokens) and max_tokens "
                f"({generation.max_tokens}) exceed the model's context of {context}"
            )
            return _error(400, message, "invalid_request_error")
        if generation.stream:
            return await self._stream(request, generation, prompt_ids, tokenizer, lane)
        job = _job(generation, prompt_ids, lambda token, logprob: None)
        try:
            resources_id = await self._submit(job, lane)
        except EngineError as exc:
            self.counts["failed"] += 1
            return _error(exc.status, str(exc), exc.kind)
        self._count(job)
        answered = _answered(tokenizer, generation, job, resources_id)
        answer = response_body(new_id(kind), lane.name, answered, kind)
        return web.Response(
            body=orjson.dumps(answer), content_type="application/json",
            headers={RESOURCES_HEADER: resources_id},
        )  # fmt: skip

    async def _stream(
        self,
        request: web.Request,
        generation: Generation,
        prompt_ids: list[int],
        tokenizer: Any,
        lane: Lane,
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue[tuple[int, float] | None] = asyncio.Queue()
        job = _job(
            generation,
            prompt_ids,
            lambda token, logprob: loop.call_soon_threadsafe(tokens.put_nowait, (token, logprob)),
        )
        job.stream = True
        done = asyncio.create_task(self._submit(job, lane))
        done.add_done_callback(lambda _: tokens.put_nowait(None))
        call_id, kind = new_id(generation.kind), generation.kind
        detokenizer = Detokenizer(tokenizer, generation.skip_special_tokens)
        response: web.StreamResponse | None = None
        while (item := await tokens.get()) is not None:
            token, logprob = item
            first = response is None
            if response is None:
                # Prepared at the first token: by then the batch has said which version answers.
                response = await _event_stream(request, job.resources_id)
            delta = detokenizer.push(token)
            await _send(
                response,
                chunk_body(
                    call_id, lane.name, kind, job.resources_id, delta, [token],
                    token_texts(tokenizer, [token]), [logprob],
                    prompt_token_ids=prompt_ids if first else None,
                ),
            )  # fmt: skip
        failure = done.exception()
        if failure is not None or response is None:
            self.counts["failed"] += 1
            status, error_kind, message = _failed(request, failure)
            if response is None:
                return _error(status, message, error_kind)
            await response.write(b"data: " + error_body(message, error_kind) + b"\n\n")
            return response
        self._count(job)
        final = chunk_body(
            call_id, lane.name, kind, job.resources_id, detokenizer.finish(),
            finish_reason=job.finish_reason,
        )  # fmt: skip
        await _send(response, final)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _submit(self, job: Job, lane: Lane) -> str:
        self.in_flight += 1
        try:
            return await lane.engine.submit(job)
        finally:
            self.in_flight -= 1

    def _count(self, job: Job) -> None:
        self.counts["requests"] += 1
        self.counts["prompt_tokens"] += len(job.prompt_ids)
        self.counts["generated_tokens"] += len(job.token_ids)


def _served_id(lane: Lane) -> str | None:
    serving = lane.engine.serving
    return serving.resources_id if serving else None


def _same_checkpoint(
    cache: ResourceCache, served: Serving, lane: Lane, checkpoint: Checkpoint
) -> bool:
    """Whether `checkpoint` is the one already served: a version that another policy's
    trainer published holds this policy's checkpoint unchanged (not loaded again)."""
    version = cache.versions.get(served.resources_id)
    held = version.resources.get(lane.resource) if version else None
    return isinstance(held, Checkpoint) and held.content_hash == checkpoint.content_hash


async def _event_stream(request: web.Request, resources_id: str) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                 RESOURCES_HEADER: resources_id},
    )  # fmt: skip
    await response.prepare(request)
    return response


async def _send(response: web.StreamResponse, chunk: dict[str, Any]) -> None:
    await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")


def _job(generation: Generation, prompt_ids: list[int], on_token: Any) -> Job:
    return Job(
        prompt_ids=prompt_ids,
        max_tokens=generation.max_tokens,
        temperature=generation.temperature,
        seed=generation.seed,
        on_token=on_token,
    )


def _answered(tokenizer: Any, generation: Generation, job: Job, resources_id: str) -> Answered:
    return Answered(
        prompt_token_ids=job.prompt_ids,
        token_ids=job.token_ids,
        logprobs=job.logprobs,
        tokens=token_texts(tokenizer, job.token_ids),
        text=str(
            tokenizer.decode(job.token_ids, skip_special_tokens=generation.skip_special_tokens)
        ),
        finish_reason=job.finish_reason,
        resources_id=resources_id,
    )


def _failed(request: web.Request, failure: BaseException | None) -> tuple[int, str, str]:
    """Status, kind and sentence of a generation that failed: the engine's own explanation,
    or (anything else) a bare 500 whose details go to the log under an error id."""
    if isinstance(failure, EngineError):
        return failure.status, failure.kind, f"generation failed: {failure}"
    problem = failure or RuntimeError("the generation ended without a token")
    _, message = http_errors.unexpected(request.method, request.path, problem)
    return 500, "server_error", message


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.Response(
        status=status, body=error_body(message, kind), content_type="application/json"
    )
