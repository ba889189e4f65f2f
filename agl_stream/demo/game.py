"""The two-agent demo's task: a referential game. A speaker is shown one of five letters and
says one word; a listener hears only that word and answers one word; both score 1 when the
listener's answer is the letter, else 0. Neither can win alone: the speaker must invent a code
and the listener must learn to read it, so the two policies learn together (two trainers,
one per policy, on the same rollouts).

The rules (`play`, `score`) are pure over two samplers; `referential_game` runs them inside
the runner on the two published checkpoints, each call recorded with its policy's name;
`joint_reward` plays them on loaded policies (the swap check: how much each trained policy
needs the other)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agl_stream.agent import Rollout, rollout
from agl_stream.demo.task import LETTERS
from agl_stream.events import Checkpoint

if TYPE_CHECKING:
    from agl_stream.training.hf import Policy

SPEAKER = "speaker"
LISTENER = "listener"
POLICIES = (SPEAKER, LISTENER)

# A prompt in, the decoded completion out (one word here).
Sampler = Callable[[str], str]


@dataclass(frozen=True)
class Play:
    letter: str
    word: str  # what the speaker said
    answer: str  # what the listener answered
    reward: float


def speaker_prompt(letter: str) -> str:
    return f"<bos> {letter}"


def listener_prompt(word: str) -> str:
    """The speaker's word after <bos>; <bos> alone when it said nothing."""
    word = word.strip()
    return f"<bos> {word}" if word else "<bos>"


def score(letter: str, answer: str) -> float:
    return 1.0 if answer.strip() == letter else 0.0


def play(letter: str, speak: Sampler, listen: Sampler) -> Play:
    """One game: the speaker sees the letter, the listener sees only the speaker's word."""
    word = speak(speaker_prompt(letter))
    answer = listen(listener_prompt(word))
    return Play(letter, word.strip(), answer.strip(), score(letter, answer))


def tasks(rng: random.Random, count: int) -> list[dict[str, Any]]:
    return [{"letter": rng.choice(LETTERS)} for _ in range(count)]


def seeded(rng: random.Random) -> Callable[[dict[str, Any], int], dict[str, Any]]:
    """A copy of a task with a sampling seed of its own (drawn from `rng`): the attempts of a
    seeded run draw the same words whenever and wherever they run."""
    return lambda task, _: {**task, "seed": rng.getrandbits(31)}


def draw_seed(task: dict[str, Any], attempt: int, policy: str) -> int | None:
    """The seed of one policy's draw in one attempt of a seeded task (None: unseeded)."""
    if not isinstance(task.get("seed"), int):
        return None
    return random.Random(f"{task['seed']}-{attempt}-{policy}").getrandbits(63)


@rollout
def referential_game(
    task: dict[str, Any], speaker: Checkpoint, listener: Checkpoint, rollout: Rollout
) -> float:
    from agl_stream.training.local_llm import local_llm
    from agl_stream.training.model import set_threads

    set_threads(1)  # several rollouts share two cores: one torch thread each
    models = {SPEAKER: local_llm(speaker), LISTENER: local_llm(listener)}

    def sampler(name: str) -> Sampler:
        def complete(prompt: str) -> str:
            answer = models[name].complete(
                prompt, max_new_tokens=1, temperature=1.0, resources_id=rollout.resources_id,
                policy=name, seed=draw_seed(task, rollout.attempt_number, name),
            )  # fmt: skip
            return answer.text

        return complete

    return play(task["letter"], sampler(SPEAKER), sampler(LISTENER)).reward


def policy_sampler(policy: Policy, generator: Any) -> Sampler:
    """One word from a loaded policy at temperature 1, drawn with `generator` (torch's): what
    `sample` draws for one new token, from the next-token distribution computed once per
    prompt (a game has at most 5 + 9 prompts, and a forward pass costs ~15 ms on a CPU)."""
    import torch

    tokenizer = policy.tokenizer
    distributions: dict[str, torch.Tensor] = {}

    def complete(prompt: str) -> str:
        probs = distributions.get(prompt)
        if probs is None:
            ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            with torch.no_grad():
                logits = policy.model(input_ids=torch.tensor([ids])).logits[0, -1]
            probs = torch.softmax(logits.float().cpu(), dim=-1)
            distributions[prompt] = probs
        token = int(torch.multinomial(probs, 1, generator=generator).item())
        return str(tokenizer.decode([token]))

    return complete


def joint_reward(
    speaker_policy: Policy, listener_policy: Policy, rng: random.Random, games: int
) -> float:
    """The mean reward of `games` games between two loaded policies, letters and samples
    drawn from `rng` (seeded: the same games for every pair compared)."""
    import torch

    generator = torch.Generator().manual_seed(rng.getrandbits(63))
    speak = policy_sampler(speaker_policy, generator)
    listen = policy_sampler(listener_policy, generator)
    total = sum(play(rng.choice(LETTERS), speak, listen).reward for _ in range(games))
    return total / games
