"""Group-relative advantages (GRPO): each sample's reward against the other attempts of the
same task. Pure code."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence


def group_advantages(
    rewards: Sequence[float], groups: Sequence[Hashable], scale: bool = True, eps: float = 1e-6
) -> list[float]:
    """(r - mean of its group) / (std of its group + eps), or without the division when
    `scale` is False (Dr. GRPO). A group of one, or of equal rewards, gives zeros: it says
    nothing about which behaviour was better."""
    if len(rewards) != len(groups):
        raise ValueError(f"{len(rewards)} rewards for {len(groups)} group labels")
    members: dict[Hashable, list[float]] = {}
    for reward, group in zip(rewards, groups, strict=True):
        if not math.isfinite(reward):
            raise ValueError(f"reward {reward!r} of group {group!r} is not a finite number")
        members.setdefault(group, []).append(reward)
    stats: dict[Hashable, tuple[float, float]] = {}
    for group, values in members.items():
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        stats[group] = (mean, std)
    out = []
    for reward, group in zip(rewards, groups, strict=True):
        mean, std = stats[group]
        centred = reward - mean
        out.append(centred / (std + eps) if scale else centred)
    return out
