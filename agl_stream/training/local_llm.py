"""Sampling from a published checkpoint inside the runner's process, each call recorded as an
LLM-call span with its token ids and logprobs: the in-process path to the same spans a served
model behind an OpenAI-compatible endpoint gives. The model is placed where
AGL_STREAM_DEVICE / AGL_STREAM_DTYPE / AGL_STREAM_THREADS say (default: a GPU if torch sees
one, else the CPU in float32)."""

from __future__ import annotations

import functools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agl_stream.agent.llm import LLMCall, record_llm_call
from agl_stream.events import Checkpoint
from agl_stream.training.checkpoints import local_directory
from agl_stream.training.device import Placement, apply_threads, placement
from agl_stream.training.hf import Policy
from agl_stream.training.model import content_hash, load_policy
from agl_stream.training.sampling import sample

_CACHE_SIZE = 2
_lock = threading.Lock()
_cache: OrderedDict[tuple[str, Placement], LocalLLM] = OrderedDict()
_bases_checked: set[tuple[str, str]] = set()  # (base directory, hash) found to match


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
        policy: str | None = None,
        seed: int | None = None,
        **sampling: Any,
    ) -> Answer:
        """Sample a completion of `prompt` and record the call as a span; `policy` names the
        policy (the resource) the checkpoint is, for the trainer of that policy (with several
        policies in one agent; without it the call is the default policy's); `seed` makes the
        draw repeatable."""
        import torch

        tokenizer = self.policy.tokenizer
        prompt_ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        started = time.time_ns()
        with self._lock:
            completion = sample(
                self.policy.model, prompt_ids, max_new_tokens, temperature,
                eos_token_id=tokenizer.eos_token_id,
                generator=None if seed is None else torch.Generator().manual_seed(seed),
            )  # fmt: skip
        text = tokenizer.decode(completion.token_ids)
        record_llm_call(
            LLMCall(
                model=self.checkpoint.uri, completion=text, prompt_text=prompt,
                prompt_token_ids=prompt_ids, response_token_ids=completion.token_ids,
                response_logprobs=completion.logprobs, resources_id=resources_id, policy=policy,
                extra={"gen_ai.request.temperature": temperature,
                       "gen_ai.request.max_tokens": max_new_tokens},
            ),
            started_ns=started,
        )  # fmt: skip
        return Answer(text, completion.token_ids, completion.logprobs)


def local_llm(checkpoint: Checkpoint, where: Placement | None = None) -> LocalLLM:
    """The model a Checkpoint resource points at, loaded once (its hash checked) and kept
    while it is one of the two most recently used; on `where` (default: the AGL_STREAM_*
    torch settings)."""
    chosen = where or _settings_placement()
    apply_threads(chosen, None)
    key = (checkpoint.content_hash, chosen)
    with _lock:
        cached = _cache.get(key)
        if cached is not None:
            _cache.move_to_end(key)
            return cached
        llm = LocalLLM(load_checkpoint(checkpoint, chosen), checkpoint)
        llm.policy.model.eval()
        _cache[key] = llm
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
        return llm


@functools.cache
def _settings_placement() -> Placement:
    """The AGL_STREAM_* torch settings, resolved once per process (not at every call)."""
    return placement()


def load_checkpoint(checkpoint: Checkpoint, where: Placement | None = None) -> Policy:
    """The policy a Checkpoint names, after checking its files against its hash: a whole
    model ("safetensors"), or a LoRA adapter ("peft") merged into its base, whose hash is
    checked too (once per process and base)."""
    directory = local_directory(checkpoint.uri)
    _check_hash(directory, checkpoint.content_hash, checkpoint.uri)
    if checkpoint.format == "safetensors":
        return load_policy(directory, where)
    if checkpoint.format != "peft":
        raise ValueError(
            f"checkpoint {checkpoint.uri} has format {checkpoint.format!r}: "
            "this release loads 'safetensors' and 'peft'"
        )
    from agl_stream.training.lora import merged

    if checkpoint.base_uri is None or checkpoint.base_content_hash is None:
        raise CheckpointMismatch(
            f"LoRA checkpoint {checkpoint.uri} names no base model (base_uri and base_content_hash)"
        )
    base = local_directory(checkpoint.base_uri)
    if (str(base), checkpoint.base_content_hash) not in _bases_checked:
        _check_hash(base, checkpoint.base_content_hash, checkpoint.base_uri)
        _bases_checked.add((str(base), checkpoint.base_content_hash))
    return merged(load_policy(base, where), directory)


def _check_hash(directory: Path, expected: str, uri: str) -> None:
    found = content_hash(directory)
    if found != expected:
        raise CheckpointMismatch(
            f"checkpoint {uri} hashes to {found}, its resources say {expected}"
        )
