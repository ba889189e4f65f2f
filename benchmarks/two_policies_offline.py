"""How fast two policies learn the referential game (agl_stream.demo.game) with the trainer's
GRPO, offline: no broker, the games sampled in this process, each policy updated on its own
calls with the group-relative advantages of the shared reward. What the two-agent demo's and
its test's settings (steps, groups a step) were chosen from.

    python -m benchmarks.two_policies_offline --steps 16 --groups 16 --seeds 8
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch

from agl_stream.demo.game import (
    LISTENER,
    SPEAKER,
    joint_reward,
    listener_prompt,
    score,
    speaker_prompt,
    tasks,
)
from agl_stream.demo.two_policies import SEEDS
from agl_stream.training.advantages import group_advantages
from agl_stream.training.batching import TrainSample
from agl_stream.training.grpo import GRPO, GRPOConfig
from agl_stream.training.hf import Policy
from agl_stream.training.model import initial_policy

Draw = Callable[[str, str], tuple[tuple[int, ...], int, float]]


def _drawer(policies: dict[str, Policy], generator: torch.Generator) -> Draw:
    """(prompt ids, token, its logprob) of one token at temperature 1, the next-token
    distribution computed once per policy and prompt (the policies do not change in a step)."""
    cache: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
    tokenizer = policies[SPEAKER].tokenizer

    def draw(name: str, prompt: str) -> tuple[tuple[int, ...], int, float]:
        ids = tuple(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if (name, ids) not in cache:
            with torch.no_grad():
                logits = policies[name].model(input_ids=torch.tensor([ids])).logits[0, -1]
            cache[name, ids] = torch.log_softmax(logits.float(), -1)
        logp = cache[name, ids]
        token = int(torch.multinomial(logp.exp(), 1, generator=generator))
        return ids, token, float(logp[token])

    return draw


def run(
    lr: float,
    seed: int,
    steps: int,
    groups: int,
    group_size: int,
    scale: bool = True,
    entropy: float = 0.0,
) -> dict[str, float]:
    policies = {name: initial_policy("tiny", s) for name, s in SEEDS.items()}
    updates = {
        name: GRPO(
            p.model,
            0,
            GRPOConfig(
                learning_rate=lr, seed=SEEDS[name], scale_rewards=scale, entropy_coef=entropy
            ),
        )
        for name, p in policies.items()
    }
    tokenizer = policies[SPEAKER].tokenizer
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    curve = []
    for _ in range(steps):
        for policy in policies.values():
            policy.model.eval()
        draw = _drawer(policies, generator)
        calls: dict[str, list[tuple[tuple[int, ...], int, float]]] = {SPEAKER: [], LISTENER: []}
        rewards, labels = [], []
        for group, task in enumerate(tasks(rng, groups)):
            for _ in range(group_size):
                spoken = draw(SPEAKER, speaker_prompt(task["letter"]))
                heard = draw(LISTENER, listener_prompt(tokenizer.decode([spoken[1]])))
                calls[SPEAKER].append(spoken)
                calls[LISTENER].append(heard)
                rewards.append(score(task["letter"], tokenizer.decode([heard[1]])))
                labels.append(group)
        curve.append(sum(rewards) / len(rewards))
        advantages = group_advantages(rewards, labels, scale=scale)
        for name, made in calls.items():
            updates[name].update(
                [
                    TrainSample((str(i), "a"), ids, (token,), r, a, 1.0, (logprob,))
                    for i, ((ids, token, logprob), r, a) in enumerate(
                        zip(made, rewards, advantages, strict=True)
                    )
                ]
            )
    for policy in policies.values():
        policy.model.eval()
    initial_speaker = initial_policy("tiny", SEEDS[SPEAKER])
    tenth = max(1, steps // 10)
    return {
        "first": sum(curve[:tenth]) / tenth,
        "last": sum(curve[-tenth:]) / tenth,
        "trained": joint_reward(policies[SPEAKER], policies[LISTENER], random.Random(0), 500),
        "swapped": joint_reward(initial_speaker, policies[LISTENER], random.Random(0), 500),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--no-scale", action="store_true", help="Dr. GRPO: no division by std")
    parser.add_argument("--entropy-coef", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        began = time.monotonic()
        found = run(
            args.lr, seed, args.steps, args.groups, args.group_size, not args.no_scale,
            args.entropy_coef,
        )  # fmt: skip
        print(
            f"seed {seed}: first tenth {found['first']:.3f}, last tenth {found['last']:.3f} "
            f"({found['last'] / found['first']:.1f}x); trained pair {found['trained']:.3f}, "
            f"initial speaker + trained listener {found['swapped']:.3f} "
            f"({time.monotonic() - began:.1f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
