"""NULs, which PostgreSQL's text and jsonb cannot hold, become U+FFFD; nothing else changes."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from agl_stream.projection import pg_text

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


def strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (k, *strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return []


@given(json_values)
def test_jsonb_is_the_value_with_each_nul_replaced(value: Any) -> None:
    stored = orjson.loads(pg_text.jsonb(value)[1:])
    assert pg_text.jsonb(value)[:1] == b"\x01"
    assert not any("\x00" in s for s in strings(stored))
    expected = orjson.loads(orjson.dumps(value).replace(b"\\u0000", b"\\ufffd"))
    if "\\u0000" not in "".join(strings(value)):  # the literal text is its own case below
        assert stored == expected


def test_a_literal_backslash_u0000_is_kept() -> None:
    value = {"path": "C:\\u0000", "nul": "a\x00b", "k\x00": ["x\x00", 1, None]}
    assert orjson.loads(pg_text.jsonb(value)[1:]) == {
        "path": "C:\\u0000",
        "nul": "a\ufffdb",
        "k\ufffd": ["x\ufffd", 1, None],
    }


def test_columns_replace_in_text_and_text_arrays_only() -> None:
    assert pg_text.column("a\x00b\x00") == "a\ufffdb\ufffd"
    assert pg_text.column(["ok", "x\x00"]) == ["ok", "x\ufffd"]
    assert pg_text.column(5) == 5
    assert pg_text.column(None) is None
    text = "no nul here"
    assert pg_text.text(text) is text


def test_lone_surrogates_from_json_text_become_replacement_characters() -> None:
    # json.loads spells them from escapes ('{"q": "\ud800"}' is valid JSON text); UTF-8 has none.
    value = {"q": "a\ud800b", "\udfff": ["\udc00"]}
    stored = orjson.loads(pg_text.jsonb(value)[1:])
    assert stored == {"q": "a\ufffdb", "\ufffd": ["\ufffd"]}
    assert pg_text.column(["x\ud800", "\x00"]) == ["x\ufffd", "\ufffd"]
