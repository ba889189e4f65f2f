"""An Agent Lightning 0.3 agent, written for Agent Lightning and nothing else: it asks the
LLM with its prompt template filled in, and scores the answer by the rules the task wanted
("[cite]" for "Cite a source.", ...). agl-stream runs it unchanged (train.py)."""

from __future__ import annotations

import json
from typing import Any

import agentlightning as agl
from openai import OpenAI

RULES = {"cite": "Cite a source.", "brief": "Be brief.", "polite": "Be polite."}
SEED_TEMPLATE = "Answer the question: {question}"


def tasks(count: int) -> list[dict[str, Any]]:
    """`count` tasks like those of tasks.jsonl (the process agent's)."""
    wants = [["cite"], ["cite", "brief"], ["polite"], ["brief"]]
    return [{"question": f"question {i}", "wants": wants[i % len(wants)]} for i in range(count)]


def score(task: dict[str, Any], answer: str) -> float:
    return sum(f"[{w}]" in answer for w in task["wants"]) / len(task["wants"])


@agl.rollout
def follow_rules(task: dict[str, Any], prompt_template: agl.PromptTemplate, llm: agl.LLM) -> float:
    client = OpenAI(base_url=llm.endpoint, api_key=llm.api_key or "unused")
    reply = client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": prompt_template.format(question=task["question"])}],
    )
    answer = reply.choices[0].message.content or ""
    agl.emit_message(json.dumps({"question": task["question"], "answer": answer}))
    return score(task, answer)
