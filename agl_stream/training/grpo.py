"""GRPO: a clipped policy-gradient update on a Hugging Face causal LM, in torch, on the
device the model is on. A mini-batch (one optimiser step) is run as micro-batches of at most
`micro_batch_tokens` padded tokens whose gradients add up to the mini-batch's: each micro-batch's
loss is divided by the whole mini-batch's weight, so splitting changes nothing but memory."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agl_stream.training.batching import TrainSample
from agl_stream.training.device import model_device
from agl_stream.training.sampling import old_logprobs, token_batch, token_logprobs_and_entropy


@dataclass(frozen=True)
class GRPOConfig:
    """Settings of the update (TRL's names where they exist)."""

    learning_rate: float = 3e-3
    epochs: int = 2  # passes over each batch; the clip matters from the second on
    minibatch_size: int = 32
    clip_epsilon: float = 0.2
    # A bonus for the entropy of the policy's next-token distributions at response tokens
    # (0: none): it keeps a policy from collapsing onto one answer before it has learned
    # (a speaker saying one word for every letter, in the two-agent game).
    entropy_coef: float = 0.0
    max_grad_norm: float = 1.0
    temperature: float = 1.0  # must match the sampler's
    scale_rewards: bool = True  # divide by the group's std (False: Dr. GRPO)
    seed: int = 0
    # Most padded tokens (rows x longest row) in one forward/backward pass; a mini-batch is
    # split into micro-batches under it and their gradients accumulated. None: no split.
    micro_batch_tokens: int | None = None
    gradient_checkpointing: bool = False  # recompute activations in backward (HF's)

    def __post_init__(self) -> None:
        if self.learning_rate <= 0 or not math.isfinite(self.learning_rate):
            raise ValueError(f"learning_rate must be a positive number, got {self.learning_rate}")
        if self.epochs < 1 or self.minibatch_size < 1:
            raise ValueError("epochs and minibatch_size must be at least 1")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ValueError(
                f"micro_batch_tokens must be at least 1, got {self.micro_batch_tokens}"
            )
        if not 0 < self.clip_epsilon < 1:
            raise ValueError(f"clip_epsilon must be in (0, 1), got {self.clip_epsilon}")
        if not 0 <= self.entropy_coef < 1 or not math.isfinite(self.entropy_coef):
            raise ValueError(f"entropy_coef must be in [0, 1), got {self.entropy_coef}")


@dataclass(frozen=True)
class UpdateStats:
    loss: float
    clipped_fraction: float
    approx_kl: float
    tokens: int


def clipped_terms(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token, averaged over each sequence's response tokens.
    Returns (per-sequence loss, tokens clipped)."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(-1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_epsilon, 1 + clip_epsilon) * adv
    per_token = -torch.minimum(unclipped, clipped) * mask
    per_sequence = per_token.sum(-1) / mask.sum(-1).clamp(min=1)
    was_clipped = ((ratio - 1).abs() > clip_epsilon).float() * mask
    return per_sequence, was_clipped.sum()


def clipped_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    clip_epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The surrogate averaged over sequences by weight. Returns (loss, fraction of tokens
    clipped)."""
    per_sequence, clipped = clipped_terms(logp, old_logp, advantages, mask, clip_epsilon)
    loss = (per_sequence * weights).sum() / weights.sum().clamp(min=1e-8)
    return loss, clipped / mask.sum().clamp(min=1)


def micro_batches(lengths: Sequence[int], budget: int | None) -> list[list[int]]:
    """Indices of sequences of these lengths in groups whose padded size (rows x longest)
    stays within `budget` (a longer sequence goes alone); longest first, so rows of like
    length share a group and little is padding. None: one group."""
    if budget is None:
        return [list(range(len(lengths)))]
    groups: list[list[int]] = []
    current: list[int] = []
    width = 0
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if current and (len(current) + 1) * max(width, lengths[index]) > budget:
            groups.append(current)
            current, width = [], 0
        current.append(index)
        width = max(width, lengths[index])
    if current:
        groups.append(current)
    return groups


def enable_checkpointing(model: Any) -> None:
    """Hugging Face's gradient (activation) checkpointing, non-reentrant: that works with a
    frozen base (LoRA), whose inputs need no grad. transformers 5.x renamed it."""
    options = {"use_reentrant": False}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


class GRPO:
    """The optimiser state of one policy and its update step."""

    def __init__(self, model: Any, pad_id: int, config: GRPOConfig) -> None:
        self.model = model
        self.pad_id = pad_id
        self.config = config
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=config.learning_rate
        )
        self._shuffle = random.Random(config.seed)
        if config.gradient_checkpointing:
            enable_checkpointing(model)

    def update(self, samples: Sequence[TrainSample]) -> UpdateStats:
        if not samples:
            raise ValueError("an update needs at least one sample")
        self.model.train()
        cfg = self.config
        losses: list[float] = []
        clipped: list[float] = []
        kls: list[float] = []
        order = list(range(len(samples)))
        for _ in range(cfg.epochs):
            self._shuffle.shuffle(order)
            for start in range(0, len(order), cfg.minibatch_size):
                chunk = [samples[i] for i in order[start : start + cfg.minibatch_size]]
                loss, clip_fraction, kl = self._step(chunk)
                losses.append(loss)
                clipped.append(clip_fraction)
                kls.append(kl)
        self.model.eval()
        tokens = sum(len(s.response_ids) for s in samples)
        return UpdateStats(
            loss=sum(losses) / len(losses),
            clipped_fraction=sum(clipped) / len(clipped),
            approx_kl=sum(kls) / len(kls),
            tokens=tokens,
        )

    def _step(self, chunk: Sequence[TrainSample]) -> tuple[float, float, float]:
        """One optimiser step on `chunk`, run as micro-batches whose gradients add up."""
        device = model_device(self.model)
        total_weight = max(sum(s.weight for s in chunk), 1e-8)
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in chunk]
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = clipped_sum = kl_sum = tokens = 0.0
        for group in micro_batches(lengths, self.config.micro_batch_tokens):
            micro = [chunk[i] for i in group]
            batch = token_batch(
                [s.prompt_ids for s in micro], [s.response_ids for s in micro], self.pad_id
            ).to(device)
            bonus = self.config.entropy_coef
            logp, spread = token_logprobs_and_entropy(
                self.model, batch, self.config.temperature, entropy=bonus > 0
            )
            old = old_logprobs([s.logprobs for s in micro], logp, batch)
            advantages = torch.tensor([s.advantage for s in micro], device=device)
            weights = torch.tensor([s.weight for s in micro], device=device)
            per_sequence, clipped = clipped_terms(
                logp, old, advantages, batch.response_mask, self.config.clip_epsilon
            )
            mask = batch.response_mask
            if spread is not None:  # the mean entropy of each sequence's response tokens
                per_sequence = per_sequence - bonus * (spread * mask).sum(-1) / mask.sum(-1).clamp(
                    min=1
                )
            loss = (per_sequence * weights).sum() / total_weight
            loss.backward()  # type: ignore[no-untyped-call]
            loss_sum += float(loss.detach())
            clipped_sum += float(clipped)
            kl_sum += float(((old - logp.detach()) * mask).sum())
            tokens += float(mask.sum())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        tokens = max(tokens, 1.0)
        return loss_sum, clipped_sum / tokens, kl_sum / tokens

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "shuffle": self._shuffle.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self._shuffle.setstate(state["shuffle"])
