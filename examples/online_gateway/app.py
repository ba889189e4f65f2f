"""A scripted "application" in production behind `agl-stream gateway`: no agl-stream code,
only the `openai` client and HTTP. Each user conversation is one session (a key in the
X-AGL-Session header, ended by the last call's X-AGL-Session-End); after the answer the user
gives feedback, which the application posts to the gateway's /rewards endpoint as the reward
named `feedback`. The trainer (--late-reward feedback) learns from the sessions joined with
their feedback, and the policy server answers with each new version.

The task is the demo's: the user shows a letter and wants it back four times; the feedback
rule scores each word 1 if it is the letter, 0.2 if another letter, else 0.

    python examples/online_gateway/app.py --gateway http://127.0.0.1:8100 --token TOKEN
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import uuid
from collections.abc import Callable

import aiohttp
import openai

LETTERS = ("a", "b", "c", "d", "e")
WORDS = 4


def feedback(letter: str, answer: str) -> float:
    """The user's verdict on an answer, from 0 to 1."""
    words = answer.split()[:WORDS]
    return sum(1.0 if w == letter else 0.2 if w in LETTERS else 0.0 for w in words) / WORDS


async def conversation(
    llm: openai.AsyncOpenAI, http: aiohttp.ClientSession, gateway: str, token: str, letter: str
) -> float:
    session = uuid.uuid4().hex
    answer = await llm.completions.create(
        model="policy",
        prompt=f"<bos> {letter}",
        max_tokens=WORDS,
        temperature=1.0,
        extra_headers={"X-AGL-Session": session, "X-AGL-Session-End": "1"},
    )
    value = feedback(letter, answer.choices[0].text)
    reward = {"session": session, "value": value, "name": "feedback", "source": "app"}
    headers = {"Authorization": f"Bearer {token}"}
    async with http.post(f"{gateway}/rewards", json=reward, headers=headers) as response:
        response.raise_for_status()
    return value


async def run(
    gateway: str,
    token: str,
    users: int = 16,
    conversations: int | None = None,
    stop: asyncio.Event | None = None,
    on_feedback: Callable[[float], None] | None = None,
    seed: int = 0,
) -> list[float]:
    """`users` at once, each holding one conversation after another, until `conversations`
    were held (or `stop` is set); returns the feedback given, in order."""
    rng = random.Random(seed)
    count = itertools.count()
    given: list[float] = []
    llm = openai.AsyncOpenAI(api_key="unused", base_url=f"{gateway}/v1", max_retries=5)
    async with aiohttp.ClientSession() as http:

        async def user() -> None:
            while (stop is None or not stop.is_set()) and (
                conversations is None or next(count) < conversations
            ):
                value = await conversation(llm, http, gateway, token, rng.choice(LETTERS))
                given.append(value)
                if on_feedback is not None:
                    on_feedback(value)

        await asyncio.gather(*(user() for _ in range(users)))
    await llm.close()
    return given


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway", default="http://127.0.0.1:8100")
    parser.add_argument("--token", required=True, help="the gateway's --reward-token")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--conversations", type=int, default=2000)
    args = parser.parse_args()
    window: list[float] = []

    def show(value: float) -> None:
        window.append(value)
        if len(window) == 100:
            print(f"mean feedback of the last 100 conversations: {sum(window) / 100:.3f}")
            window.clear()

    asyncio.run(run(args.gateway, args.token, args.users, args.conversations, on_feedback=show))


if __name__ == "__main__":
    main()
