"""An Agent Lightning 0.3 agent, written for Agent Lightning and nothing else: it asks the
LLM with its prompt template filled in, and scores the answer by the rules the task wanted
("[cite]" for "Cite a source.", ...). agl-stream runs it unchanged (train.py).

Its one resource is the prompt template; its LLM comes from the environment (OPENAI_BASE_URL,
OPENAI_API_KEY, AGENT_MODEL), as in Agent Lightning's own APO examples: the resources APO
publishes for each candidate hold its prompt template and nothing else."""

from __future__ import annotations

import json
import os
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
def follow_rules(task: dict[str, Any], prompt_template: agl.PromptTemplate) -> float:
    client = OpenAI()
    reply = client.chat.completions.create(
        model=os.environ.get("AGENT_MODEL", "tiny"),
        messages=[{"role": "user", "content": prompt_template.format(question=task["question"])}],
    )
    answer = reply.choices[0].message.content or ""
    agl.emit_message(json.dumps({"question": task["question"], "answer": answer}))
    return score(task, answer)
