"""What APO says to the optimizer LLM and how it reads the answers (pure code).

Two requests per parent template and round, as in Agent Lightning's APO (after ProTeGi's
"textual gradients"): a critique of the template from the attempts that went worst with it,
then rewrites that follow the critique. A rewrite is read from between <template> tags (else
from a fenced block, else the whole answer) and kept only if it names exactly the
placeholders of its parent and is new.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from agl_stream.events.templates import TemplateError, placeholders

MAX_MESSAGE_CHARS = 1500  # of each message shown to the critic
MAX_TEMPLATE_CHARS = 20_000

CRITIQUE_SYSTEM = (
    "You review the prompt template of an AI agent. You are shown the template and attempts "
    "in which the agent, prompted with it, did badly: the task input, the conversation, and "
    "the reward it earned (higher is better). Say what in the template led to these results "
    "and what a better template would say instead, in at most five short bullet points."
)

REWRITE_SYSTEM = (
    "You improve the prompt template of an AI agent by following a critique of it. Keep every "
    "placeholder in braces exactly as written, add no new ones, and answer with the whole new "
    "template between <template> and </template>, nothing else."
)


@dataclass(frozen=True)
class Example:
    """One attempt shown to the critic."""

    input: Any
    messages: tuple[dict[str, str], ...]
    reward: float | None
    error: str | None = None


def _clip(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 15] + " ...[truncated]"


def _describe(number: int, example: Example) -> str:
    lines = [f"## Attempt {number}", f"Task input: {_clip(json.dumps(example.input))}"]
    for message in example.messages:
        lines.append(f"[{message.get('role', '?')}] {_clip(str(message.get('content', '')))}")
    if not example.messages:
        lines.append("(the agent made no LLM call that was recorded)")
    reward = "none (the attempt failed)" if example.reward is None else f"{example.reward:g}"
    lines.append(f"Reward: {reward}")
    if example.error:
        lines.append(f"Error: {_clip(example.error)}")
    return "\n".join(lines)


def critique_messages(template: str, examples: Sequence[Example]) -> list[dict[str, str]]:
    shown = "\n\n".join(_describe(i + 1, e) for i, e in enumerate(examples))
    user = f"<template>\n{template}\n</template>\n\n{shown or '(no attempts finished)'}"
    return [{"role": "system", "content": CRITIQUE_SYSTEM}, {"role": "user", "content": user}]


def rewrite_messages(
    template: str, critique: str, names: Collection[str], variant: int, variants: int
) -> list[dict[str, str]]:
    keep = ", ".join("{" + n + "}" for n in sorted(names)) or "none"
    user = (
        f"<template>\n{template}\n</template>\n\n<critique>\n{critique.strip()}\n</critique>\n\n"
        f"Placeholders to keep: {keep}. This is rewrite {variant + 1} of {variants}: make it "
        "differ from the others."
    )
    return [{"role": "system", "content": REWRITE_SYSTEM}, {"role": "user", "content": user}]


_TAGGED = re.compile(r"<template>\s*\n?(.*?)\n?\s*</template>", re.DOTALL)
_FENCED = re.compile(r"```[^\n]*\n(.*?)\n?```", re.DOTALL)


def read_candidate(answer: str) -> str:
    """The template in an optimizer's answer: tagged, else fenced, else the whole of it."""
    for pattern in (_TAGGED, _FENCED):
        match = pattern.search(answer)
        if match:
            return match.group(1).strip()
    return answer.strip()


def check_candidate(candidate: str, parent: str, engine: str, known: Collection[str]) -> str | None:
    """Why a rewrite cannot be a candidate, or None when it can."""
    if not candidate:
        return "the answer held no template"
    if len(candidate) > MAX_TEMPLATE_CHARS:
        return f"the template is {len(candidate):,} characters, over {MAX_TEMPLATE_CHARS:,}"
    if candidate in known:
        return "the same template as the parent or an earlier candidate"
    try:
        names = placeholders(candidate, engine)
    except TemplateError as exc:
        return str(exc)
    wanted = placeholders(parent, engine)
    if names != wanted:
        lost = ", ".join("{" + n + "}" for n in sorted(wanted - names))
        added = ", ".join("{" + n + "}" for n in sorted(names - wanted))
        parts = [f"dropped {lost}" if lost else "", f"added {added}" if added else ""]
        return "placeholders changed: " + "; ".join(p for p in parts if p)
    return None
