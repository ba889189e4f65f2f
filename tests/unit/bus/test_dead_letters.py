"""Dead letters carry the reason and the origin; they keep the original headers."""

from __future__ import annotations

from datetime import UTC, datetime

from agl_stream.bus import dead_letters as dl


def test_dead_letter_headers_and_key() -> None:
    letter = dl.dead_letter(
        topic="agl.spans", partition=3, offset=77, timestamp_ms=1234, value=b"\x00junk",
        headers=[("trace", b"t1"), ("agl.dlq.reason", b"stale")], reason="undecodable body",
        kind="undecodable", consumer="agl-projector", now=datetime(2026, 1, 1, tzinfo=UTC),
    )  # fmt: skip
    assert letter.key == b"agl.spans:3:77"
    assert letter.value == b"\x00junk"
    headers = dict(letter.headers)
    assert headers["trace"] == b"t1"
    assert headers[dl.REASON] == b"undecodable body"
    assert headers[dl.SOURCE_TOPIC] == b"agl.spans"
    assert headers[dl.SOURCE_PARTITION] == b"3"
    assert headers[dl.SOURCE_OFFSET] == b"77"
    assert headers[dl.SOURCE_TIMESTAMP] == b"1234"
    assert headers[dl.CONSUMER] == b"agl-projector"
    assert [k for k, _ in letter.headers].count(dl.REASON) == 1  # an old reason is replaced


def test_view_parses_what_was_written() -> None:
    letter = dl.dead_letter(
        topic="agl.tasks", partition=0, offset=5, timestamp_ms=None, value=None, headers=[],
        reason="r", kind="invalid", consumer="c",
    )  # fmt: skip
    view = dl.DeadLetterView.parse(letter.headers, letter.value, dlq_offset=9)
    assert (view.source_topic, view.source_partition, view.source_offset) == ("agl.tasks", 0, 5)
    assert (view.reason, view.kind, view.consumer, view.dlq_offset) == ("r", "invalid", "c", 9)
