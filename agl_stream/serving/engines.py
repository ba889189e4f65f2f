"""What the policy server asks of an engine (torch in this process, or vLLM in a child):
the version it serves with its tokenizer, loading a published checkpoint, and generating
one request's tokens. The server does the rest (the OpenAI API, versions, catching up), so
answers look the same whichever engine gives them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from agl_stream.events import Checkpoint

OnToken = Callable[[int, float], None]


@dataclass
class Job:
    """One request's generation."""

    prompt_ids: Sequence[int]
    max_tokens: int
    temperature: float
    seed: int | None
    on_token: OnToken
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"
    resources_id: str = ""  # the version that answers, set before the first token
    stream: bool = False  # the caller reads tokens as they come (on_token)


@dataclass(frozen=True)
class Serving:
    """The version an engine answers with now."""

    resources_id: str
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    context: int  # prompt and generated tokens together


class EngineError(RuntimeError):
    """A call the engine could not answer; `status` and `kind` are the HTTP answer's."""

    status = 502
    kind = "engine_error"


class EngineUnavailable(EngineError):
    """The engine stopped (and is being restarted): the call may be sent again."""

    status = 503
    kind = "engine_unavailable"


class Engine(Protocol):
    @property
    def serving(self) -> Serving | None: ...

    @property
    def down(self) -> str | None:
        """Why the engine cannot answer now (it is restarting, say); None while it can."""

    @property
    def url(self) -> str | None:
        """The engine's own address, where it has one (benchmarks call vLLM directly)."""

    async def load(self, resources_id: str, checkpoint: Checkpoint) -> None:
        """Serve `checkpoint` as `resources_id` from the next call on; a checkpoint that
        cannot be served raises ValueError (or OSError) with the reason, and the version
        served before stays."""

    async def submit(self, job: Job) -> str:
        """Generate `job` (filling its tokens, logprobs and finish reason); returns the
        resources id that answered. EngineError when the engine cannot."""

    async def run(self) -> None:
        """The engine's own work, for as long as it serves."""

    async def close(self) -> None: ...

    def stats(self) -> Mapping[str, int | float]:
        """Counters for /health and /metrics."""


@runtime_checkable
class SharedEngine(Protocol):
    """An engine several policies share (vLLM with a LoRA adapter per policy): each policy
    is a lane, an Engine of its own for loading and calls; the shared engine is run and
    closed once."""

    def lane(self, name: str) -> Engine: ...
