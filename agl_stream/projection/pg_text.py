"""Text PostgreSQL can hold. Its text and jsonb types take no U+0000 (NUL), which events may
carry (an LLM's output, an exception's message), and UTF-8 has no lone surrogate, which JSON
text can spell (`"\\ud800"` in a task's input); a row holding either would fail its whole
batch again at every restart. The read model stores each as U+FFFD (the replacement
character); the record on its topic keeps the original. Pure code.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

NUL = "\x00"
REPLACEMENT = "\ufffd"
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def text(value: str) -> str:
    return _UNSTORABLE.sub(REPLACEMENT, value)


def json_value(value: Any) -> Any:
    """A JSON value with every NUL in its strings (keys too) replaced."""
    if isinstance(value, str):
        return text(value)
    if isinstance(value, dict):
        return {text(str(k)): json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_value(v) for v in value]
    return value


def jsonb(value: Any) -> bytes:
    """A value as binary jsonb (version byte 1, then the JSON text), NULs replaced."""
    try:
        data = orjson.dumps(value)
    except orjson.JSONEncodeError:  # a lone surrogate (orjson takes no text UTF-8 cannot hold)
        data = orjson.dumps(json_value(value))
    if b"\\u0000" in data:  # how orjson writes a NUL (a literal backslash-u0000 matches too:
        # the walk then changes nothing)
        data = orjson.dumps(json_value(value))
    return b"\x01" + data


def column(value: Any) -> Any:
    """A column's value with NULs replaced in its text (str, or a list as text[])."""
    if isinstance(value, str):
        return text(value)
    if isinstance(value, list):
        return [column(v) for v in value]
    return value
