"""Token-level sampling and scoring with a causal LM, in torch, on the device the model is
on: the same log-probabilities the sampler records are what the trainer recomputes (same
temperature, same positions; computed in float32 whatever the weights' dtype)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agl_stream.training.device import model_device


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]


@torch.no_grad()
def sample(
    model: Any,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
) -> Completion:
    """Sample up to `max_new_tokens` tokens after the prompt (stopping at EOS)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    device = model_device(model)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    out_ids: list[int] = []
    out_logprobs: list[float] = []
    past = None
    step_input = ids
    for _ in range(max_new_tokens):
        output = model(input_ids=step_input, past_key_values=past, use_cache=True)
        past = output.past_key_values
        # Drawn on the CPU: a CPU generator (the seed) works whatever the model's device.
        logp = torch.log_softmax(output.logits[0, -1].float().cpu() / temperature, dim=-1)
        token = int(torch.multinomial(logp.exp(), 1, generator=generator).item())
        out_ids.append(token)
        out_logprobs.append(float(logp[token]))
        if eos_token_id is not None and token == eos_token_id:
            break
        step_input = torch.tensor([[token]], dtype=torch.long, device=device)
    return Completion(out_ids, out_logprobs)


@dataclass(frozen=True)
class TokenBatch:
    """Prompt + response sequences, right-padded; `response_mask[b, t]` is 1 where the token
    at position t+1 is a response token (logits at t predict it)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    response_mask: torch.Tensor

    def to(self, device: torch.device | str) -> TokenBatch:
        return TokenBatch(
            self.input_ids.to(device), self.attention_mask.to(device),
            self.targets.to(device), self.response_mask.to(device),
        )  # fmt: skip


def token_batch(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int
) -> TokenBatch:
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(lengths), width), dtype=torch.long)
    response_mask = torch.zeros((len(lengths), width - 1), dtype=torch.float32)
    for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        sequence = list(prompt) + list(response)
        input_ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        attention[row, : len(sequence)] = 1
        response_mask[row, len(prompt) - 1 : len(sequence) - 1] = 1.0
    return TokenBatch(input_ids, attention, input_ids[:, 1:], response_mask)


def token_logprobs(model: Any, batch: TokenBatch, temperature: float = 1.0) -> torch.Tensor:
    """log p(token t+1 | tokens <= t), shape (batch, width - 1), from the batch's first
    response position on; 0 before it, where no row has a response token. The logits of
    those prompt positions are not computed (Hugging Face's `logits_to_keep`): with a real
    vocabulary (49,152 words for SmolLM2) they were a large share of a short answer's update."""
    return token_logprobs_and_entropy(model, batch, temperature, entropy=False)[0]


def token_logprobs_and_entropy(
    model: Any, batch: TokenBatch, temperature: float = 1.0, entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """token_logprobs, and (with `entropy`) the entropy of each position's next-token
    distribution, laid out alike."""
    width = batch.input_ids.shape[1]
    first = first_response_position(batch)
    logits = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False,
        logits_to_keep=width - first,
    ).logits  # fmt: skip
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = logp.gather(-1, batch.targets[:, first:].unsqueeze(-1)).squeeze(-1)
    spread = -(logp.exp() * logp).sum(-1) if entropy else None
    pad = torch.nn.functional.pad
    return pad(picked, (first, 0)), None if spread is None else pad(spread, (first, 0))


def first_response_position(batch: TokenBatch) -> int:
    """The first position whose logits predict a response token in any row (0: none)."""
    columns = batch.response_mask.any(dim=0).nonzero()
    return int(columns[0]) if len(columns) else 0


def old_logprobs(
    recorded: Sequence[Sequence[float] | None], current: torch.Tensor, batch: TokenBatch
) -> torch.Tensor:
    """The behaviour policy's log-probabilities: those the sampler recorded where it did,
    else the current policy's (detached), laid out like `current`."""
    old = current.detach().clone()
    for row, values in enumerate(recorded):
        if values is None:
            continue
        positions = batch.response_mask[row].nonzero().squeeze(-1)
        if len(values) != len(positions):
            raise ValueError(
                f"sample {row}: {len(values)} recorded logprobs for {len(positions)} tokens"
            )
        old[row, positions] = torch.tensor(list(values), dtype=old.dtype, device=old.device)
    return old
