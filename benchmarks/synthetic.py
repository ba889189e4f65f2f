"""A synthetic agent shaped like a real multi-round agent, for the runner benchmark.

Per rollout: 1..max_rounds rounds (random); each round a span with two nested child spans
carrying 2-6 random attributes (nested up to depth 3, strings of 5-300 characters); a reward
span in half of the rounds; then a final span and a final reward. Optional sleep per span.
"""

from __future__ import annotations

import asyncio
import random
import string
from typing import Any

from agl_stream.agent import emit_reward, rollout
from agl_stream.agent.tracing import tracer

LETTERS = string.ascii_letters + string.digits + " "


def _value(rng: random.Random, depth: int) -> Any:
    kind = rng.random()
    if depth < 3 and kind < 0.2:
        return {f"k{i}": _value(rng, depth + 1) for i in range(rng.randint(1, 3))}
    if kind < 0.6:
        return "".join(rng.choices(LETTERS, k=rng.randint(5, 300)))
    if kind < 0.8:
        return rng.randint(0, 1_000_000)
    return rng.random()


def attributes(rng: random.Random) -> dict[str, Any]:
    return {f"attr.{i}": _value(rng, 1) for i in range(rng.randint(2, 6))}


@rollout
async def agent(task: dict[str, Any]) -> float:
    rng = random.Random(task.get("seed"))
    rounds = rng.randint(1, int(task.get("max_rounds", 10)))
    sleep = float(task.get("sleep", 0))
    tr = tracer()
    for number in range(rounds):
        with tr.start_as_current_span("round", attributes={"round": number}):
            for child in ("llm.call", "tool.call"):
                with tr.start_as_current_span(child, attributes=_flat(attributes(rng))):
                    if sleep:
                        await asyncio.sleep(sleep)
        if number % 2 == 0:
            emit_reward(rng.random())
    with tr.start_as_current_span("final", attributes={"rounds": rounds}):
        pass
    return rng.random()


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
