"""Sampling from a published checkpoint inside the runner's process (CPU), each call
recorded as an LLM-call span with its token ids and logprobs: the in-process path to the
same spans a served model behind an OpenAI-compatible endpoint gives."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agl_stream.agent.llm import LLMCall, record_llm_call
from agl_stream.events import Checkpoint
from agl_stream.training.checkpoints import checkpoint_root
from agl_stream.training.model import Policy, content_hash, load_policy
from agl_stream.training.sampling import sample

_CACHE_SIZE = 2
_lock = threading.Lock()
_cache: OrderedDict[str, LocalLLM] = OrderedDict()


class CheckpointMismatch(ValueError):
    """The checkpoint's files do not hash to what its resources version says."""


@dataclass(frozen=True)
class Answer:
    text: str
    token_ids: list[int]
    logprobs: list[float]


class LocalLLM:
    def __init__(self, policy: Policy, checkpoint: Checkpoint) -> None:
        self.policy = policy
        self.checkpoint = checkpoint
        self._lock = threading.Lock()  # one generation at a time per model

    def complete(
        self,
        prompt: str,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        resources_id: str | None = None,
        **sampling: Any,
    ) -> Answer:
        """Sample a completion of `prompt` and record the call as a span."""
        tokenizer = self.policy.tokenizer
        prompt_ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        started = time.time_ns()
        with self._lock:
            completion = sample(
                self.policy.model, prompt_ids, max_new_tokens, temperature,
                eos_token_id=tokenizer.eos_token_id,
            )  # fmt: skip
        text = tokenizer.decode(completion.token_ids)
        record_llm_call(
            LLMCall(
                model=self.checkpoint.uri, completion=text, prompt_text=prompt,
                prompt_token_ids=prompt_ids, response_token_ids=completion.token_ids,
                response_logprobs=completion.logprobs, resources_id=resources_id,
                extra={"gen_ai.request.temperature": temperature,
                       "gen_ai.request.max_tokens": max_new_tokens},
            ),
            started_ns=started,
        )  # fmt: skip
        return Answer(text, completion.token_ids, completion.logprobs)


def local_llm(checkpoint: Checkpoint) -> LocalLLM:
    """The model a Checkpoint resource points at, loaded once (its hash checked) and kept
    while it is one of the two most recently used."""
    with _lock:
        cached = _cache.get(checkpoint.content_hash)
        if cached is not None:
            _cache.move_to_end(checkpoint.content_hash)
            return cached
        directory = Path(checkpoint_root(checkpoint.uri))
        found = content_hash(directory)
        if found != checkpoint.content_hash:
            raise CheckpointMismatch(
                f"checkpoint {checkpoint.uri} hashes to {found}, "
                f"its resources say {checkpoint.content_hash}"
            )
        llm = LocalLLM(load_policy(directory), checkpoint)
        llm.policy.model.eval()
        _cache[checkpoint.content_hash] = llm
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
        return llm
