"""Redaction of span attributes, applied in the runner before a span leaves the process.

Two kinds of rule: keys (glob patterns of attribute names, case-insensitive) whose values are
replaced whole, and patterns (regular expressions) whose matches inside any string value are
replaced, naming the rule (`[REDACTED:email]`) so that a reader sees what was there. Key rules
default to names that only ever hold secrets (passwords, API keys, authorization headers);
pattern rules are chosen per deployment, since they rewrite what an agent saw and said, which
is training data. Built-in patterns: `email` and `api_key` (OpenAI, Anthropic, AWS, GitHub,
Google, Slack keys and bearer tokens); anything else given is a regular expression.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field, field_validator

from agl_stream.events.spans import AttributeValue, SpanRecorded, SpanStatus
from agl_stream.runtime.config import _Settings

REDACTED = "[REDACTED]"

DEFAULT_KEYS = (
    "*password*", "*passwd*", "*secret*", "*api_key*", "*api-key*", "*apikey*",
    "*authorization*", "*access_token*", "*refresh_token*", "*private_key*", "*cookie*",
)  # fmt: skip

BUILTIN_PATTERNS = {
    "email": r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}",
    "api_key": "|".join(
        (
            r"\bsk-[A-Za-z0-9_-]{20,}",  # OpenAI, Anthropic (sk-ant-...), most compatibles
            r"\bAKIA[0-9A-Z]{16}\b",  # AWS access key ids
            r"\bgh[pousr]_[A-Za-z0-9]{36,}",  # GitHub
            r"\bAIza[0-9A-Za-z_-]{35}",  # Google
            r"\bxox[abprs]-[A-Za-z0-9-]{10,}",  # Slack
            r"(?i:\bbearer\s+)[A-Za-z0-9._~+/-]{16,}=*",  # any bearer token
        )
    ),
}


class RedactionSettings(_Settings):
    """AGL_STREAM_REDACT_KEYS and AGL_STREAM_REDACT_PATTERNS, as JSON lists."""

    redact_keys: list[str] = Field(
        default_factory=lambda: list(DEFAULT_KEYS),
        description="Glob patterns of attribute names whose values are replaced whole.",
    )
    redact_patterns: list[str] = Field(
        default_factory=list,
        description="Built-in pattern names (email, api_key) or regular expressions.",
    )

    @field_validator("redact_patterns")
    @classmethod
    def _compiles(cls, value: list[str]) -> list[str]:
        for pattern in value:
            if pattern in BUILTIN_PATTERNS:
                continue
            try:
                compiled = re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"{pattern!r} is not a regular expression ({exc})") from None
            if compiled.match(""):
                raise ValueError(f"{pattern!r} matches the empty string")
        return value

    def rules(self) -> Redaction:
        return Redaction.of(self.redact_keys, self.redact_patterns)


@dataclass(frozen=True)
class Redaction:
    """Compiled rules; `span` is pure (a span in, a redacted copy out)."""

    keys: re.Pattern[str] | None = None
    patterns: tuple[tuple[str, re.Pattern[str]], ...] = ()
    _secret_key: dict[str, bool] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def of(keys: Sequence[str] = DEFAULT_KEYS, patterns: Sequence[str] = ()) -> Redaction:
        key_rule = (
            re.compile("|".join(f"(?:{fnmatch.translate(k.lower())})" for k in keys))
            if keys
            else None
        )
        compiled = tuple(
            (name, re.compile(BUILTIN_PATTERNS[name]))
            if name in BUILTIN_PATTERNS
            else ("pattern", re.compile(name))
            for name in patterns
        )
        return Redaction(key_rule, compiled)

    @property
    def active(self) -> bool:
        return self.keys is not None or bool(self.patterns)

    def is_secret(self, key: str) -> bool:
        if self.keys is None:
            return False
        known = self._secret_key.get(key)
        if known is None:
            known = self._secret_key[key] = self.keys.match(key.lower()) is not None
            if len(self._secret_key) > 10_000:  # bounded: attribute names are few in practice
                self._secret_key.clear()
        return known

    def text(self, value: str) -> str:
        for name, pattern in self.patterns:
            value = pattern.sub(f"[REDACTED:{name}]", value)
        return value

    def value(self, value: AttributeValue) -> AttributeValue:
        if isinstance(value, str):
            return self.text(value) if self.patterns else value
        if isinstance(value, list) and self.patterns:
            return [self.text(v) if isinstance(v, str) else v for v in value]
        return value

    def attributes(self, attributes: Mapping[str, AttributeValue]) -> dict[str, AttributeValue]:
        return {k: REDACTED if self.is_secret(k) else self.value(v) for k, v in attributes.items()}

    def span(self, span: SpanRecorded) -> SpanRecorded:
        """The span with every attribute map (its own, its events', links' and resource's)
        and its status description redacted; the span itself when nothing changed."""
        if not self.active:
            return span
        update: dict[str, Any] = {}
        for name in ("attributes", "resource"):
            before = getattr(span, name)
            after = self.attributes(before)
            if after != before:
                update[name] = after
        events = tuple(
            e.model_copy(update={"attributes": self.attributes(e.attributes)}) for e in span.events
        )
        if events != span.events:
            update["events"] = events
        links = tuple(
            link.model_copy(update={"attributes": self.attributes(link.attributes)})
            for link in span.links
        )
        if links != span.links:
            update["links"] = links
        description = span.status.description
        if description and self.patterns and self.text(description) != description:
            update["status"] = SpanStatus(code=span.status.code, description=self.text(description))
        return span.model_copy(update=update) if update else span


NO_REDACTION = Redaction()
