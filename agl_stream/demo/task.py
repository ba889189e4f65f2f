"""The demo's task: echo a letter. The agent is shown one of five letters and must answer
with four words; each word that is the letter scores 1, any other letter 0.2, anything else
0. A random policy scores about 0.2 (so GRPO has signal from the first step); a policy
that learned the task scores 1.

`echo_letter` is written as users write agents: the plain `openai` client against the LLM
resource it is given (the runner's gateway, in front of `agl-stream serve`).
`echo_letter_in_process` samples the checkpoint inside the runner instead (no server)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import openai

from agl_stream.agent import Rollout, rollout
from agl_stream.events import LLM, Checkpoint
from agl_stream.training.local_llm import local_llm
from agl_stream.training.model import set_threads

LETTERS = ("a", "b", "c", "d", "e")
ANSWER_WORDS = 4


def score(letter: str, answer: str) -> float:
    """Mean over the first ANSWER_WORDS words of the answer (missing words score 0)."""
    words = answer.split()[:ANSWER_WORDS]
    points = [1.0 if w == letter else 0.2 if w in LETTERS else 0.0 for w in words]
    return sum(points) / ANSWER_WORDS


def tasks(rng: random.Random, count: int) -> list[dict[str, Any]]:
    return [{"letter": rng.choice(LETTERS)} for _ in range(count)]


_shared: tuple[asyncio.AbstractEventLoop, openai.AsyncOpenAI] | None = None


def _client(endpoint: str) -> openai.AsyncOpenAI:
    """One client per process (per event loop), pointed at each attempt's endpoint: a new
    AsyncOpenAI costs ~30 ms of CPU (it loads the TLS certificates, even for plain http),
    which blocked the runner's loop for every rollout."""
    global _shared
    loop = asyncio.get_running_loop()
    if _shared is None or _shared[0] is not loop:
        _shared = (loop, openai.AsyncOpenAI(api_key="unused", base_url=endpoint))
    return _shared[1].with_options(base_url=endpoint)


async def echo_letter(task: dict[str, Any], llm: LLM) -> float:
    answer = await _client(llm.endpoint).completions.create(
        model=llm.model, prompt=f"<bos> {task['letter']}", max_tokens=ANSWER_WORDS,
        temperature=1.0,
    )  # fmt: skip
    return score(task["letter"], answer.choices[0].text)


@rollout
def echo_letter_in_process(task: dict[str, Any], policy: Checkpoint, rollout: Rollout) -> float:
    set_threads(1)  # several rollouts share two cores: one torch thread each
    llm = local_llm(policy)
    answer = llm.complete(
        f"<bos> {task['letter']}", max_new_tokens=ANSWER_WORDS, resources_id=rollout.resources_id
    )
    return score(task["letter"], answer.text)
