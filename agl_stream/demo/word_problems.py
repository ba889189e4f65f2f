"""The real model's task: arithmetic word problems answered with a number.

"Mia has 7 stamps and gets 12 more. How many stamps does Mia have now? Answer with just the
number." The reward is 1 when the last number of the answer is the sum, else 0 (the final
number is the answer, as GSM8K's graders read it; a list of guesses scores only by its last).
SmolLM2-135M-Instruct answers 15% of the held-out set right, greedy, at 24 tokens: it
knows small sums but talks around them ("Lea has 12 apples, and she gets 6 more. So, Lea
has 12 +" runs out of tokens), so what it can learn is to answer, and to answer right.

The held-out set is fixed (HELDOUT_SIZE questions from HELDOUT_SEED); training draws never
ask one of its questions. `solve` is written as users write agents: the plain `openai` client
against the LLM resource it is given (its runner's gateway), temperature TRAIN_TEMPERATURE
for training attempts and greedy for `val` ones (the held-out evaluation).
"""

from __future__ import annotations

import asyncio
import functools
import random
import re
from typing import Any

import openai

from agl_stream.agent import Rollout
from agl_stream.events import LLM, RolloutMode

NAMES = ("Sam", "Ana", "Tom", "Lea", "Max", "Mia")
THINGS = ("apples", "books", "coins", "pens", "stamps", "cards")
LOW, HIGH = 2, 20  # the two numbers added
MAX_TOKENS = 24
TRAIN_TEMPERATURE = 0.7  # the trainer's --temperature must be the same
HELDOUT_SEED = 20261127
HELDOUT_SIZE = 200
_NUMBER = re.compile(r"-?\d+")


def question(name: str, a: int, b: int, thing: str) -> str:
    return (
        f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now? "
        "Answer with just the number."
    )


def draw(rng: random.Random) -> dict[str, Any]:
    """One problem: its question and the answer."""
    a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
    text = question(rng.choice(NAMES), a, b, rng.choice(THINGS))
    return {"question": text, "answer": a + b}


@functools.cache
def heldout(size: int = HELDOUT_SIZE) -> tuple[dict[str, Any], ...]:
    """The fixed held-out set: `size` distinct problems (never trained on)."""
    rng = random.Random(HELDOUT_SEED)
    seen: set[str] = set()
    items: list[dict[str, Any]] = []
    while len(items) < size:
        item = draw(rng)
        if item["question"] not in seen:
            seen.add(item["question"])
            items.append(item)
    return tuple(items)


@functools.cache
def _heldout_questions() -> frozenset[str]:
    return frozenset(item["question"] for item in heldout())


def tasks(rng: random.Random, count: int) -> list[dict[str, Any]]:
    """`count` training problems, none of them a held-out question."""
    out: list[dict[str, Any]] = []
    while len(out) < count:
        item = draw(rng)
        if item["question"] not in _heldout_questions():
            out.append(item)
    return out


def score(answer: str, expected: int) -> float:
    """1.0 when the last number in the answer is `expected`, else 0.0."""
    numbers = _NUMBER.findall(answer.replace(",", ""))
    return 1.0 if numbers and int(numbers[-1]) == expected else 0.0


_shared: tuple[asyncio.AbstractEventLoop, openai.AsyncOpenAI] | None = None


def client(endpoint: str) -> openai.AsyncOpenAI:
    """One client per process (per event loop), pointed at each attempt's endpoint: a new
    AsyncOpenAI costs ~30 ms of CPU."""
    global _shared
    loop = asyncio.get_running_loop()
    if _shared is None or _shared[0] is not loop:
        _shared = (loop, openai.AsyncOpenAI(api_key="unused", base_url=endpoint))
    return _shared[1].with_options(base_url=endpoint)


async def solve(task: dict[str, Any], llm: LLM, rollout: Rollout) -> float:
    """Ask the model the question; the reward is whether it answered the sum."""
    greedy = rollout.mode is not RolloutMode.TRAIN
    answer = await client(llm.endpoint).chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": task["question"]}],
        max_tokens=MAX_TOKENS,
        temperature=0.0 if greedy else TRAIN_TEMPERATURE,
    )
    return score(answer.choices[0].message.content or "", int(task["answer"]))
