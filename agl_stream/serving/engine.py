"""Generation with a Hugging Face causal LM on the device it was placed on, batching the
requests that arrive together: prompts left-padded, one forward pass per step for the whole
batch with a KV cache, each row sampled at its own temperature (0: greedy) and stopped at EOS
or its token limit. Tokens are handed out as they are sampled, for streaming."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agl_stream.events import Checkpoint
from agl_stream.serving.engines import Job, Serving
from agl_stream.training.device import Placement, model_device
from agl_stream.training.hf import Policy
from agl_stream.training.local_llm import local_llm

__all__ = ["Batcher", "Job", "Loaded", "TorchEngine", "generate"]


@dataclass
class Loaded:
    """The policy being served and the resources version it came from."""

    policy: Policy
    resources_id: str


@torch.no_grad()
def generate(model: Any, jobs: Sequence[Job], pad_id: int, eos_id: int | None) -> None:
    """Run `jobs` as one batch, filling each job's tokens, logprobs and finish reason."""
    width = max(len(job.prompt_ids) for job in jobs)
    count = len(jobs)
    device = model_device(model)
    input_ids = torch.full((count, width), pad_id, dtype=torch.long)
    mask = torch.zeros((count, width), dtype=torch.long)
    for row, job in enumerate(jobs):
        input_ids[row, width - len(job.prompt_ids) :] = torch.tensor(list(job.prompt_ids))
        mask[row, width - len(job.prompt_ids) :] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    generators = [_generator(job.seed) for job in jobs]
    temperatures = [job.temperature for job in jobs]
    active = [True] * count
    past = None
    step_ids = input_ids
    for _ in range(max(job.max_tokens for job in jobs)):
        output = model(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=past,
            use_cache=True,
        )
        past = output.past_key_values
        logits = output.logits[:, -1].float().cpu()  # picked on the CPU, with CPU generators
        next_ids = torch.full((count, 1), pad_id, dtype=torch.long)
        for row, job in enumerate(jobs):
            if not active[row]:
                continue
            token, logprob = _pick(logits[row], temperatures[row], generators[row])
            job.token_ids.append(token)
            job.logprobs.append(logprob)
            job.on_token(token, logprob)
            next_ids[row, 0] = token
            if eos_id is not None and token == eos_id:
                job.finish_reason, active[row] = "stop", False
            elif len(job.token_ids) >= job.max_tokens:
                active[row] = False
        if not any(active):
            return
        step_ids = next_ids.to(device)
        mask = torch.cat([mask, torch.ones((count, 1), dtype=torch.long, device=device)], dim=-1)
        positions = positions[:, -1:] + 1


def _generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def _pick(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[int, float]:
    """A token and its logprob under the distribution it was drawn from (greedy: T=1)."""
    if temperature <= 0:
        logp = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logp).item())
    else:
        logp = torch.log_softmax(logits / temperature, dim=-1)
        token = int(torch.multinomial(logp.exp(), 1, generator=generator).item())
    return token, float(logp[token])


class Batcher:
    """Collects the jobs that arrive within `window` seconds (up to `max_batch`) and runs
    them together in a worker thread; swapping the policy takes effect between batches."""

    def __init__(self, loaded: Loaded, max_batch: int = 32, window: float = 0.005) -> None:
        self.loaded = loaded
        self.max_batch = max_batch
        self.window = window
        self.batches = 0
        self._queue: asyncio.Queue[tuple[Job, asyncio.Future[str]]] = asyncio.Queue()
        self._lock = threading.Lock()

    def swap(self, loaded: Loaded) -> None:
        with self._lock:
            self.loaded = loaded

    async def submit(self, job: Job) -> str:
        """Run `job`; returns the resources id of the policy that answered it."""
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        await self._queue.put((job, future))
        return await future

    async def run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            deadline = asyncio.get_running_loop().time() + self.window
            while len(batch) < self.max_batch:
                remaining = deadline - asyncio.get_running_loop().time()
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), max(remaining, 0)))
                except TimeoutError:
                    break
            with self._lock:
                loaded = self.loaded
            live = [(job, future) for job, future in batch if not future.done()]
            if not live:
                continue
            for job, _ in live:
                job.resources_id = loaded.resources_id
            tokenizer = loaded.policy.tokenizer
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
            try:
                await asyncio.to_thread(
                    generate, loaded.policy.model, [job for job, _ in live], pad,
                    tokenizer.eos_token_id,
                )  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - the requests get the error, the loop lives
                for _, future in live:
                    if not future.done():
                        future.set_exception(exc)
                continue
            self.batches += 1
            for _, future in live:
                if not future.done():
                    future.set_result(loaded.resources_id)


class TorchEngine:
    """The policy run with torch in this process, batching concurrent requests."""

    def __init__(self, max_batch: int = 32, placement: Placement | None = None) -> None:
        self.max_batch = max_batch
        self.placement = placement  # where a loaded checkpoint runs (None: the settings')
        self.batcher: Batcher | None = None
        self._serving: Serving | None = None
        self._ready = asyncio.Event()

    @property
    def serving(self) -> Serving | None:
        return self._serving

    @property
    def down(self) -> str | None:
        return None

    @property
    def url(self) -> str | None:
        return None

    def put(self, loaded: Loaded) -> None:
        """Serve `loaded` from the next batch on."""
        loaded.policy.model.eval()
        if self.batcher is None:
            self.batcher = Batcher(loaded, self.max_batch)
            self._ready.set()
        else:
            self.batcher.swap(loaded)
        config = loaded.policy.model.config
        context = int(getattr(config, "max_position_embeddings", 2048))
        self._serving = Serving(loaded.resources_id, loaded.policy.tokenizer, context)

    async def load(self, resources_id: str, checkpoint: Checkpoint) -> None:
        """A whole model, or a LoRA adapter merged into its base (local_llm checks both)."""
        llm = await asyncio.to_thread(local_llm, checkpoint, self.placement)
        self.put(Loaded(llm.policy, resources_id))

    async def submit(self, job: Job) -> str:
        assert self.batcher is not None, "nothing is served yet"
        return await self.batcher.submit(job)

    async def run(self) -> None:
        await self._ready.wait()
        assert self.batcher is not None
        await self.batcher.run()

    async def close(self) -> None:
        pass

    def stats(self) -> Mapping[str, int | float]:
        return {"batches": self.batcher.batches if self.batcher else 0}
