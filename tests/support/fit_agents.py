"""Agents that Trainer.fit tests hand over as objects; fit finds them here by name, as
runner processes import them."""

from __future__ import annotations

from typing import Any

from agl_stream.agent import rollout
from agl_stream.demo.task import echo_letter
from agl_stream.events import LLM, PromptTemplate


async def letter(task: dict[str, Any], llm: LLM) -> float:
    """The demo's task, as a user's own agent."""
    return await echo_letter(task, llm)


@rollout
def greeter(task: dict[str, Any], prompt: PromptTemplate) -> float:
    """1.0 when the prompt, filled in with the task's name, is the greeting it expects."""
    return 1.0 if prompt.format(name=task["name"]) == task["expected"] else 0.0


async def unrewarded_letter(task: dict[str, Any], llm: LLM) -> float:
    """The demo's task earning nothing itself: its reward comes later, from outside."""
    await echo_letter(task, llm)
    return 0.0
