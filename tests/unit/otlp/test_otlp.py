"""OTLP payloads (protobuf and JSON) into spans of rollouts and attempts; malformed payloads
refused with the reason; a span joins an attempt no ingester started only with its key."""

from __future__ import annotations

import json

import pytest

from agl_stream.events import RolloutMode, SpanKind, StatusCode
from agl_stream.otlp.decode import OtlpError, decode_json, decode_protobuf, decode_request
from agl_stream.otlp.mapping import attempt_key, map_request
from tests.support.otlp_payloads import otlp_json, request, span

TRACE = 0x0AF7651916CD43DD8448EB211C80319C


def _payload() -> object:
    return request(
        [
            span(TRACE, 1, "agent.run", **{"agl.rollout.id": "conv-1", "agl.rollout.mode": "val"}),
            span(TRACE, 2, "llm.call-fail", parent=1, **{"agl.rollout.id": "conv-1",
                 "gen_ai.usage.input_tokens": 12, "ok": True, "t": 0.5, "blob": b"\x01\xff",
                 "ids": [1, 2], "nested": {"a": {"b": "c"}, "list": [{"x": 1}]}}),
            span(TRACE + 1, 3, "orphan"),
            span(TRACE + 1, 4, "orphan.child", parent=3),
        ],
        resource={"agl.attempt.id": "otlp-att-9"},
    )  # fmt: skip


def test_spans_map_to_rollouts_and_attempts_by_their_attributes() -> None:
    mapped = map_request(decode_protobuf(_payload().SerializeToString()))  # type: ignore[attr-defined]
    by_id = {s.span_id: s for s in mapped.spans}
    root, call = by_id[f"{1:016x}"], by_id[f"{2:016x}"]
    assert (root.rollout_id, root.attempt_id, call.parent_span_id) == (
        "conv-1",
        "otlp-att-9",
        root.span_id,
    )
    assert (call.kind, call.status.code, call.status.description) == (
        SpanKind.CLIENT, StatusCode.ERROR, "boom",
    )  # fmt: skip
    assert call.attributes == {
        "agl.rollout.id": "conv-1", "gen_ai.usage.input_tokens": 12, "ok": True, "t": 0.5,
        "blob": "01ff", "ids": [1, 2], "nested.a.b": "c", "nested.list.0.x": 1,
    }  # fmt: skip
    assert call.resource == {"service.name": "shop", "agl.attempt.id": "otlp-att-9"}
    assert call.scope_name == "app" and call.sequence == 2
    # No rollout attribute: one unattributed rollout per trace.
    orphans = {s.rollout_id for s in mapped.spans if s.name.startswith("orphan")}
    assert orphans == {f"otlp-trace-{TRACE + 1:032x}"}
    started = mapped.attempts[("conv-1", "otlp-att-9")]
    assert started.task is not None and started.task.mode is RolloutMode.VAL
    assert json.loads(started.task.input_json) == {"trace_id": f"{TRACE:032x}"}
    assert len(mapped.attempts) == 2


def test_otlp_json_reads_as_the_protobuf_does() -> None:
    payload = _payload()
    from_json = map_request(decode_json(json.dumps(otlp_json(payload)).encode()))  # type: ignore[arg-type]
    from_proto = map_request(decode_protobuf(payload.SerializeToString()))  # type: ignore[attr-defined]
    strip = {"event_id", "occurred_at"}
    assert [s.model_dump(exclude=strip) for s in from_json.spans] == [
        s.model_dump(exclude=strip) for s in from_proto.spans
    ]


@pytest.mark.parametrize(
    ("body", "content_type", "says"),
    [
        (b"\xff\xff\xff", "application/x-protobuf", "not an OTLP ExportTraceServiceRequest"),
        (b"{", "application/json", "not JSON"),
        (b"[]", "application/json", "a JSON object"),
        (b'{"resourceSpans": 3}', "application/json", "not an OTLP/JSON"),
        (
            b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}',
            "application/json",
            "traceId 'zz' is not hex",
        ),
        (b"{}", "text/plain", "is not OTLP"),
    ],
)
def test_unreadable_payloads_say_why(body: bytes, content_type: str, says: str) -> None:
    with pytest.raises(OtlpError) as caught:
        decode_request(body, content_type)
    assert says in str(caught.value)


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ({"trace_id": b"\x01" * 8}, "trace_id must be 16 bytes"),
        ({"span_id": b""}, "span_id is missing"),
        ({"trace_id": b"\x00" * 16}, "not all zero"),
        ({"start_time_unix_nano": 2**63}, "after the last time a span can hold"),
    ],
)
def test_spans_without_proper_ids_are_refused(bad: dict[str, object], says: str) -> None:
    payload = request([span(TRACE, 1, "x")])
    target = payload.resource_spans[0].scope_spans[0].spans[0]
    for field, raw in bad.items():
        setattr(target, field, raw)
    with pytest.raises(OtlpError, match="spans\\[0\\]") as caught:
        map_request(payload)
    assert says in str(caught.value)


@pytest.mark.parametrize(
    ("attributes", "says"),
    [
        ({"agl.rollout.id": "r", "agl.rollout.mode": "prod"}, "agl.rollout.mode is 'prod'"),
        ({"agl.rollout.id": "r", "agl.rollout.input": "{not json"}, "must be JSON text"),
    ],
)
def test_bad_mapping_attributes_are_refused(attributes: dict[str, str], says: str) -> None:
    with pytest.raises(OtlpError) as caught:
        map_request(request([span(TRACE, 1, "x", **attributes)]))
    assert says in str(caught.value)


SECRET = "otlp-ingester-token-0123456789"


def test_a_span_joins_an_attempt_it_did_not_start_only_with_its_key() -> None:
    """The hostile tester's payload: an `agl.reward` of -100 into a runner's attempt (32 hex
    digits) of a finished rollout. Without the attempt's key it is refused whole; with it the
    span joins the attempt (no AttemptStarted: the attempt is its runner's), and the key is
    not kept on the span."""
    runner_attempt = "8c7a53b1f0d94e0c9e1f2b3c4d5e6f70"
    ids = {"agl.rollout.id": "ro-trained", "agl.attempt.id": runner_attempt}
    poison = request([span(TRACE, 7, "agl.reward", **ids, **{"agl.reward": -100.0})])
    for secret in (None, SECRET):
        with pytest.raises(OtlpError) as caught:
            map_request(poison, secret)
        assert "which no OTLP ingester started" in str(caught.value)
        assert "agl.attempt.key" in str(caught.value)

    wrong = request([span(TRACE, 7, "x", **ids, **{"agl.attempt.key": "0" * 64})])
    with pytest.raises(OtlpError, match="is not the key of attempt"):
        map_request(wrong, SECRET)
    other = attempt_key(SECRET, "ro-other", runner_attempt)  # another rollout's key
    with pytest.raises(OtlpError, match="is not the key of attempt"):
        map_request(request([span(TRACE, 7, "x", **ids, **{"agl.attempt.key": other})]), SECRET)
    key = attempt_key(SECRET, "ro-trained", runner_attempt)
    keyed = request([span(TRACE, 7, "tool")], resource={**ids, "agl.attempt.key": key})
    with pytest.raises(OtlpError, match="no token to check it with"):
        map_request(keyed, None)

    mapped = map_request(keyed, SECRET)
    (joined,) = mapped.spans
    assert (joined.rollout_id, joined.attempt_id) == ("ro-trained", runner_attempt)
    assert mapped.attempts == {}
    assert "agl.attempt.key" not in joined.resource and "agl.attempt.key" not in joined.attributes
    assert key not in str(joined.model_dump())


def test_the_ingesters_own_attempts_need_no_key() -> None:
    own = request([span(TRACE, 1, "a", **{"agl.rollout.id": "shop-1"}),
                   span(TRACE, 2, "b", **{"agl.rollout.id": "shop-1",
                                          "agl.attempt.id": "otlp-retry-2"})])  # fmt: skip
    mapped = map_request(own)
    assert sorted(mapped.attempts) == [("shop-1", f"otlp-{TRACE:032x}"), ("shop-1", "otlp-retry-2")]
    assert {s.worker_id for s in mapped.attempts.values()} == {"otlp"}
