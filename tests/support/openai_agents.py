"""Agents written with the plain `openai` client and no agl-stream import: the runner hands
them an LLM resource (an object with `endpoint` and `model`), they call it like any
OpenAI-compatible server. Importable as tests.support.openai_agents:NAME."""

from __future__ import annotations

import asyncio
from typing import Any

import openai


def _client(llm: Any, **options: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=llm.endpoint, api_key="not-needed", **options)


async def chat(task: dict[str, Any], llm: Any) -> float:
    """A multi-turn conversation: each turn sends everything so far, the answer included;
    odd turns stream, even turns do not; one plain completion at the end."""
    async with _client(llm) as client:
        return await _conversation(client, task, llm.model)


async def _conversation(client: openai.AsyncOpenAI, task: dict[str, Any], model: str) -> float:
    messages: list[dict[str, str]] = [{"role": "system", "content": task["system"]}]
    for turn, question in enumerate(task["questions"]):
        messages.append({"role": "user", "content": question})
        if turn % 2:
            stream = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=12, stream=True
            )
            parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            answer = "".join(parts)
        else:
            reply = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=12
            )
            answer = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": answer})
    await client.completions.create(model=model, prompt=task["system"], max_tokens=6)
    return float(len(messages))


async def persistent(task: dict[str, Any], llm: Any) -> float:
    """Keeps calling (streaming, several at once) until it has task['calls'] answers, and
    tries a call again when the server fails under it. Its reward says what it saw:
    1000 x the calls it completed + the errors it was given."""
    async with _client(llm, max_retries=0, timeout=30) as client:
        return await _keep_calling(client, task, llm.model)


async def _keep_calling(client: openai.AsyncOpenAI, task: dict[str, Any], model: str) -> float:
    done = 0
    failures = 0

    async def one() -> None:
        nonlocal done, failures
        while done < task["calls"]:
            try:
                stream = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "go on"}],
                    max_tokens=task.get("max_tokens", 200), stream=True,
                )  # fmt: skip
                async for _ in stream:
                    pass
                done += 1
            except openai.APIError:
                failures += 1
                await asyncio.sleep(0.2)

    await asyncio.gather(*(one() for _ in range(task.get("parallel", 3))))
    return float(done * 1000 + failures)


async def speaker_then_listener(task: dict[str, Any], llm: Any) -> float:
    """Two policies through one LLM resource: the model named in each call picks the policy
    (the gateway routes it to the server of that policy)."""
    async with _client(llm) as client:
        said = await client.completions.create(model="speaker", prompt=task["say"], max_tokens=3)
        heard = said.choices[0].text
        await client.completions.create(model="listener", prompt=heard or ".", max_tokens=3)
        await client.completions.create(model=llm.model, prompt="again", max_tokens=2)
    return 1.0
