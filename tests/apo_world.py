"""A small world for APO tests, in which a prompt's wording measurably matters.

No instruction-following LLM can run on these machines (no hosted API, no weights to
download; the tiny models the project trains write noise), so this module serves an
OpenAI-compatible HTTP endpoint whose "model" follows rules by rote:

- as the agent's model it obeys the rules its prompt states ("Cite a source." -> the answer
  carries [cite]), and nothing else;
- as the optimizer it reads APO's critique request like a careful reviewer would (which
  rules the tasks wanted that the answers lacked, most often first) and its rewrite request
  by adding one missing rule: rewrite 1 the least wanted, rewrite 2 the most wanted, rewrite 3
  a broken template that drops the placeholder (APO must reject it).

So which rewrite is better is only known by measuring it, as with a real LLM.

`follow_rules` is the agent, written with the plain openai client.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from typing import Any

import openai
from aiohttp import web

from agl_stream.training.apo.prompts import CRITIQUE_SYSTEM, REWRITE_SYSTEM

RULES = {"cite": "Cite a source.", "brief": "Be brief.", "polite": "Be polite."}
WANTED = {"cite": 0.8, "brief": 0.5, "polite": 0.2}  # how often a task wants each rule
SEED_TEMPLATE = "Answer the question: {question}"
CALLS = web.AppKey("calls", list)  # what the endpoint was asked, in order


def tasks(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        wants = [r for r, p in WANTED.items() if rng.random() < p] or ["cite"]
        out.append({"question": f"question {i}", "wants": wants})
    return out


def score(task: dict[str, Any], answer: str) -> float:
    return sum(f"[{w}]" in answer for w in task["wants"]) / len(task["wants"])


async def follow_rules(task: dict[str, Any], prompt: Any, llm: Any) -> float:
    """The agent: ask the model with the prompt template filled in; score what it answers."""
    async with openai.AsyncOpenAI(base_url=llm.endpoint, api_key="unused") as client:
        reply = await client.chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": prompt.format(question=task["question"])}],
        )
    return score(task, reply.choices[0].message.content or "")


# -- the endpoint ------------------------------------------------------------------------------


def _follow(text: str) -> str:
    return " ".join(f"[{r}]" for r, phrase in RULES.items() if phrase in text) + " an answer"


def _missing(user: str) -> list[str]:
    """Rules the attempts' tasks wanted and their answers lacked, most often first."""
    counts: Counter[str] = Counter()
    for block in user.split("## Attempt")[1:]:
        found = re.search(r"Task input: (.*)", block)
        if not found:
            continue
        wants = json.loads(found.group(1)).get("wants", [])
        answers = " ".join(re.findall(r"\[assistant\] (.*)", block))
        counts.update(w for w in wants if f"[{w}]" not in answers)
    return [rule for rule, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def _critique(user: str) -> str:
    missing = _missing(user)
    if not missing:
        return "- The answers did what the tasks wanted."
    return "\n".join(f"- The template never asks to: {RULES[rule]}" for rule in missing)


def _rewrite(user: str) -> str:
    template = re.search(r"<template>\n(.*?)\n</template>", user, re.DOTALL)
    assert template is not None
    current = template.group(1)
    by_phrase = {phrase: rule for rule, phrase in RULES.items()}
    asked = [by_phrase[p] for p in re.findall(r"never asks to: (.*)", user)]  # most often first
    variant = int(re.search(r"This is rewrite (\d+) of", user).group(1))  # type: ignore[union-attr]
    if variant >= 3:
        return "<template>\nAnswer the question well.\n</template>"
    if not asked:
        return f"<template>\n{current}\n</template>"
    rule = asked[-1] if variant == 1 else asked[0]
    return f"<template>\n{RULES[rule]} {current}\n</template>"


async def _chat(request: web.Request) -> web.Response:
    body = await request.json()
    messages = body["messages"]
    system = messages[0]["content"] if messages[0]["role"] == "system" else ""
    user = messages[-1]["content"]
    if system == CRITIQUE_SYSTEM:
        text = _critique(user)
    elif system == REWRITE_SYSTEM:
        text = _rewrite(user)
    else:
        text = _follow(" ".join(m["content"] for m in messages))
    request.app[CALLS].append(system[:12] or "agent")
    return web.json_response({
        "id": f"chatcmpl-{len(request.app[CALLS])}", "object": "chat.completion",
        "created": 0, "model": body.get("model", "rules"),
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    })  # fmt: skip


def app() -> web.Application:
    application = web.Application()
    application[CALLS] = []
    application.router.add_post("/v1/chat/completions", _chat)
    return application
