"""GRPO: a clipped policy-gradient update on a Hugging Face causal LM, in torch. The same
code runs a tiny model on a CPU and a real checkpoint on a GPU."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agl_stream.training.batching import TrainSample
from agl_stream.training.sampling import old_logprobs, token_batch, token_logprobs


@dataclass(frozen=True)
class GRPOConfig:
    """Settings of the update (TRL's names where they exist)."""

    learning_rate: float = 3e-3
    epochs: int = 2  # passes over each batch; the clip matters from the second on
    minibatch_size: int = 32
    clip_epsilon: float = 0.2
    max_grad_norm: float = 1.0
    temperature: float = 1.0  # must match the sampler's
    scale_rewards: bool = True  # divide by the group's std (False: Dr. GRPO)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.learning_rate <= 0 or not math.isfinite(self.learning_rate):
            raise ValueError(f"learning_rate must be a positive number, got {self.learning_rate}")
        if self.epochs < 1 or self.minibatch_size < 1:
            raise ValueError("epochs and minibatch_size must be at least 1")
        if not 0 < self.clip_epsilon < 1:
            raise ValueError(f"clip_epsilon must be in (0, 1), got {self.clip_epsilon}")


@dataclass(frozen=True)
class UpdateStats:
    loss: float
    clipped_fraction: float
    approx_kl: float
    tokens: int


def clipped_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    clip_epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token, averaged over each sequence's response tokens,
    then over sequences by weight. Returns (loss, fraction of tokens clipped)."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(-1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_epsilon, 1 + clip_epsilon) * adv
    per_token = -torch.minimum(unclipped, clipped) * mask
    per_sequence = per_token.sum(-1) / mask.sum(-1).clamp(min=1)
    loss = (per_sequence * weights).sum() / weights.sum().clamp(min=1e-8)
    was_clipped = ((ratio - 1).abs() > clip_epsilon).float() * mask
    return loss, was_clipped.sum() / mask.sum().clamp(min=1)


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
        batch = token_batch(
            [s.prompt_ids for s in chunk], [s.response_ids for s in chunk], self.pad_id
        )
        logp = token_logprobs(self.model, batch, self.config.temperature)
        old = old_logprobs([s.logprobs for s in chunk], logp, batch)
        advantages = torch.tensor([s.advantage for s in chunk], dtype=torch.float32)
        weights = torch.tensor([s.weight for s in chunk], dtype=torch.float32)
        loss, clip_fraction = clipped_loss(
            logp, old, advantages, weights, batch.response_mask, self.config.clip_epsilon
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        mask = batch.response_mask
        approx_kl = ((old - logp.detach()) * mask).sum() / mask.sum().clamp(min=1)
        return float(loss.detach()), float(clip_fraction), float(approx_kl)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "shuffle": self._shuffle.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self._shuffle.setstate(state["shuffle"])
