"""An agent for the real model's short test: the word-problem agent's call (the plain `openai`
client, a chat completion at the demo's temperature) with a reward that always varies within
a group (the share of digits in the answer), so every step updates the weights."""

from __future__ import annotations

from typing import Any

import openai

from agl_stream.demo.word_problems import MAX_TOKENS, TRAIN_TEMPERATURE
from agl_stream.events import LLM


async def digits(task: dict[str, Any], llm: LLM) -> float:
    # A client per call, closed after it: the test's event loops end with the test.
    async with openai.AsyncOpenAI(api_key="unused", base_url=llm.endpoint) as client:
        answer = await client.chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": task["question"]}],
            max_tokens=MAX_TOKENS,
            temperature=TRAIN_TEMPERATURE,
        )
    text = answer.choices[0].message.content or ""
    return sum(c.isdigit() for c in text) / max(1, len(text))
