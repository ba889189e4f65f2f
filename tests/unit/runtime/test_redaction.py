"""Redaction rules for span attributes: secret-named keys replaced whole, e-mail addresses and
API keys replaced inside any string, everything else untouched (training data stays as it
was); bad rules are refused with a sentence naming the setting."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agl_stream.events.spans import SpanEvent, SpanLink, SpanRecorded, SpanStatus, StatusCode
from agl_stream.runtime.config import ConfigError, load
from agl_stream.runtime.redaction import REDACTED, Redaction, RedactionSettings

KEY = "sk-proj-" + "A1b2C3d4E5f6G7h8I9j0" * 2


def span(**attributes: object) -> SpanRecorded:
    return SpanRecorded(
        rollout_id="r", attempt_id="a", sequence=0, trace_id="0" * 32, span_id="1" * 16,
        name="agl.message", start_time_unix_nano=1, end_time_unix_nano=2,
        attributes=attributes,  # type: ignore[arg-type]
    )  # fmt: skip


def test_default_rules_replace_secret_named_keys_and_keep_training_data() -> None:
    rules = Redaction.of()
    before = span(
        **{
            "http.request.header.authorization": "Bearer abc",
            "db.password": "hunter2",
            "OPENAI_API_KEY": 12345,
            "llm.token_ids": [1, 2, 3],
            "gen_ai.usage.input_tokens": 17,
            "gen_ai.prompt.0.content": f"write to ann@example.com with {KEY}",
        }
    )
    after = rules.span(before).attributes
    assert after["http.request.header.authorization"] == REDACTED
    assert after["db.password"] == REDACTED
    assert after["OPENAI_API_KEY"] == REDACTED
    assert after["llm.token_ids"] == [1, 2, 3]
    assert after["gen_ai.usage.input_tokens"] == 17
    # Patterns are chosen per deployment: by default prompts are left as they were.
    assert after["gen_ai.prompt.0.content"] == before.attributes["gen_ai.prompt.0.content"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("mail ann.lee+x@mail.example.co.uk now", "mail [REDACTED:email] now"),
        (f"key {KEY}.", "key [REDACTED:api_key]."),
        ("aws AKIAABCDEFGHIJKLMNOP here", "aws [REDACTED:api_key] here"),
        ("gh ghp_" + "a" * 36, "gh [REDACTED:api_key]"),
        ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30.sig", "Authorization: [REDACTED:api_key]"),
        ("no secrets: sk-short, a@b, 2 + 2", "no secrets: sk-short, a@b, 2 + 2"),
    ],
)
def test_builtin_patterns(text: str, expected: str) -> None:
    assert Redaction.of(patterns=["email", "api_key"]).text(text) == expected


def test_patterns_reach_lists_events_links_resource_and_status() -> None:
    rules = Redaction.of(keys=[], patterns=["email", r"\b\d{4}-\d{4}-\d{4}-\d{4}\b"])
    before = span(to=["a@example.com", 3, None], card="4111-1111-1111-1111").model_copy(
        update={
            "events": (SpanEvent(name="e", time_unix_nano=1, attributes={"x": "b@example.org"}),),
            "links": (SpanLink(trace_id="2" * 32, span_id="3" * 16, attributes={"y": "c@x.io"}),),
            "resource": {"host.owner": "ops@example.net"},
            "status": SpanStatus(code=StatusCode.ERROR, description="failed for d@example.com"),
        }
    )
    after = rules.span(before)
    assert after.attributes == {"to": ["[REDACTED:email]", 3, None], "card": "[REDACTED:pattern]"}
    assert after.events[0].attributes == {"x": "[REDACTED:email]"}
    assert after.links[0].attributes == {"y": "[REDACTED:email]"}
    assert after.resource == {"host.owner": "[REDACTED:email]"}
    assert after.status == SpanStatus(
        code=StatusCode.ERROR, description="failed for [REDACTED:email]"
    )
    assert (after.rollout_id, after.attempt_id, after.sequence) == ("r", "a", 0)


def test_a_span_with_nothing_to_redact_is_the_same_object() -> None:
    clean = span(step=1, text="hello")
    assert Redaction.of(patterns=["email"]).span(clean) is clean
    assert Redaction.of(keys=[]).span(clean) is clean


@given(st.dictionaries(st.text(max_size=12), st.text(max_size=40), max_size=6))
def test_redacting_twice_changes_nothing_more(attributes: dict[str, str]) -> None:
    rules = Redaction.of(patterns=["email", "api_key"])
    once = rules.span(span(**attributes))
    assert rules.span(once).attributes == once.attributes


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGL_STREAM_REDACT_KEYS", '["*ssn*"]')
    monkeypatch.setenv("AGL_STREAM_REDACT_PATTERNS", '["email", "\\\\d{3}-\\\\d{2}-\\\\d{4}"]')
    rules = load(RedactionSettings).rules()
    after = rules.span(span(user_ssn="1", note="ssn 123-45-6789 of x@y.com", password="p"))
    assert after.attributes == {
        "user_ssn": REDACTED,
        "note": "ssn [REDACTED:pattern] of [REDACTED:email]",
        "password": "p",  # the configured keys replace the defaults
    }


@pytest.mark.parametrize(
    ("pattern", "message"),
    [("(unclosed", "is not a regular expression"), ("x*", "matches the empty string")],
)
def test_a_bad_pattern_is_refused_naming_the_setting(pattern: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        load(RedactionSettings, redact_patterns=[pattern])
    assert "--redact-pattern / AGL_STREAM_REDACT_PATTERNS" in str(caught.value)
