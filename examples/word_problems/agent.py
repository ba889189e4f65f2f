"""The word-problem agent as a user writes it: plain `openai` client code and a checkable
reward, nothing of agl-stream's but the decorator-free signature a runner calls
(`agent(task, llm, rollout)`). `agl_stream.demo.word_problems:solve` is the same agent,
packaged so that `agl-stream demo --model ...` finds it installed.

    agl-stream worker runner --agent examples.word_problems.agent:solve
"""

from __future__ import annotations

import re
from typing import Any

import openai

NUMBER = re.compile(r"-?\d+")


def reward(answer: str, expected: int) -> float:
    """1 when the answer's last number is the sum (how GSM8K's graders read an answer)."""
    numbers = NUMBER.findall(answer.replace(",", ""))
    return 1.0 if numbers and int(numbers[-1]) == expected else 0.0


async def solve(task: dict[str, Any], llm: Any, rollout: Any) -> float:
    # The runner hands each attempt its own URL on its gateway, which records the call with
    # its token ids and the version that answered; the trainer learns from that record.
    client = openai.AsyncOpenAI(api_key="unused", base_url=llm.endpoint)
    greedy = rollout.mode != "train"  # held-out (val) attempts answer greedily
    answer = await client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": task["question"]}],
        max_tokens=24,
        temperature=0.0 if greedy else 0.7,
    )
    return reward(answer.choices[0].message.content or "", int(task["answer"]))
