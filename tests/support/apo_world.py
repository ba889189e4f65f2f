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

It also plays the optimizer of Agent Lightning's own APO (examples/agl_agent/train.py), whose
prompts (its POML files) it recognises by their content: a critique request (the template,
then each run's chat messages or spans and reward) is answered like agl-stream's, with the
rules the runs' questions wanted that their answers lacked, most often first; an apply-edit
request ("Revise the ...", the template, then the critique) by the template with the rules the
critique names stated before it (one only, the first, when asked to address ONE critique
point). Those prompts carry no task input, and this world's questions ("question 3") say
nothing of what they want, so the endpoint is given the answer key (question -> rules wanted)
that a reviewer reading a real question would work out from it.

`follow_rules` is the agent, written with the plain openai client.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai
from aiohttp import web

from agl_stream.training.apo.prompts import CRITIQUE_SYSTEM, REWRITE_SYSTEM

RULES = {"cite": "Cite a source.", "brief": "Be brief.", "polite": "Be polite."}
WANTED = {"cite": 0.8, "brief": 0.5, "polite": 0.2}  # how often a task wants each rule
SEED_TEMPLATE = "Answer the question: {question}"
CALLS = web.AppKey("calls", list)  # what the endpoint was asked, in order
MODELS = web.AppKey("models", list)  # (call, the model it was asked of), in order
ANSWER_KEY = web.AppKey("answer_key", dict)  # question -> rules it wants (Agent Lightning's APO)


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


# Agent Lightning's APO: its runs are headed "## Experiment 1" or "## Sample Run #1 ...".
_AGL_RUN = re.compile(r"^#+ (?:Experiment \d+|Sample Run #\d+)", re.MULTILINE)
_AGL_EDIT = re.compile(
    r"#+ (?:Prompt Template|PROMPT)\n\n(.*?)\n\n#+ (?:Critique|CRITIQUE)\n\n(.*)", re.DOTALL
)


def _agl_critique(text: str, answer_key: dict[str, list[str]]) -> str:
    counts: Counter[str] = Counter()
    for run in _AGL_RUN.split(text)[1:]:
        for question in set(re.findall(r"question \d+", run)):
            counts.update(w for w in answer_key.get(question, []) if f"[{w}]" not in run)
    missing = [rule for rule, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    if not missing:
        return "- The answers did what the tasks wanted."
    return "\n".join(f"- The template never asks to: {RULES[rule]}" for rule in missing)


def _agl_apply_edit(system: str, user: str) -> str:
    found = _AGL_EDIT.search(user)
    assert found is not None, user
    template, critique = found.groups()
    asked = re.findall(r"never asks to: (.*)", critique)  # most often first
    if "ONE critique point" in system:
        asked = asked[:1]
    return " ".join([*asked, template])


def _answer(app: web.Application, messages: list[dict[str, str]]) -> tuple[str, str]:
    """What the endpoint answers, and the name of the call it took it for."""
    system = messages[0]["content"] if messages[0]["role"] == "system" else ""
    user = messages[-1]["content"]
    text = "\n".join(m["content"] for m in messages)
    if system == CRITIQUE_SYSTEM:
        return _critique(user), system[:12]
    if system == REWRITE_SYSTEM:
        return _rewrite(user), system[:12]
    if system.startswith("Revise the") and _AGL_EDIT.search(user):
        return _agl_apply_edit(system, user), "agl-edit"
    if "critique" in text.lower() and _AGL_RUN.search(text):
        return _agl_critique(text, app[ANSWER_KEY]), "agl-critique"
    return _follow(text), "agent"


async def _chat(request: web.Request) -> web.Response:
    body = await request.json()
    text, call = _answer(request.app, body["messages"])
    request.app[CALLS].append(call)
    request.app[MODELS].append((call, body.get("model")))
    return web.json_response({
        "id": f"chatcmpl-{len(request.app[CALLS])}", "object": "chat.completion",
        "created": 0, "model": body.get("model", "rules"),
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    })  # fmt: skip


def app(answer_key: dict[str, list[str]] | None = None) -> web.Application:
    """The endpoint; `answer_key` (question -> rules it wants) for Agent Lightning's APO."""
    application = web.Application()
    application[CALLS] = []
    application[MODELS] = []
    application[ANSWER_KEY] = answer_key or {}
    application.router.add_post("/v1/chat/completions", _chat)
    return application


@contextmanager
def serving_in_thread(
    answer_key: dict[str, list[str]] | None = None,
) -> Iterator[tuple[str, web.Application]]:
    """The endpoint on a free port, on a thread and event loop of its own (for code that runs
    its own loop, as Trainer.fit does): its URL and app."""
    application = app(answer_key)
    ready: list[str] = []
    started = threading.Event()
    stopping: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    async def serve() -> None:
        stop = asyncio.Event()
        stopping.append((asyncio.get_running_loop(), stop))
        runner = web.AppRunner(application)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            host, port = runner.addresses[0][:2]
            ready.append(f"http://{host}:{port}/v1")
            started.set()
            await stop.wait()
        finally:
            await runner.cleanup()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    try:
        assert started.wait(30), "the rules endpoint did not start"
        yield ready[0], application
    finally:
        loop, stop = stopping[0]
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
