"""Where the gateway records calls that carry no attempt."""

from __future__ import annotations

import os
import socket

import pytest

from agl_stream.agent.tracing import tracer
from agl_stream.gateway.recording import UNATTRIBUTED, CallLog


def test_a_restarted_gateway_records_under_an_attempt_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A container restarted keeps its hostname and has pid 1 again: the new process numbers
    its calls from 0 too, so with the same attempt id the read model (one span per rollout,
    attempt and sequence) dropped its calls as duplicates of the old process's."""
    monkeypatch.setattr(socket, "gethostname", lambda: "box")
    monkeypatch.setattr(os, "getpid", lambda: 1)
    before, after = CallLog(), CallLog()
    for log in (before, after):
        with tracer().start_as_current_span("agl.llm.call") as span:
            pass
        log.record(span)  # type: ignore[arg-type]
    (first,), (second,) = before.drain(), after.drain()
    assert first.sequence == second.sequence == 0
    assert first.rollout_id == second.rollout_id == UNATTRIBUTED
    keys = {(e.rollout_id, e.attempt_id, e.sequence) for e in (first, second)}
    assert len(keys) == 2
    assert before.attempt_id.startswith("gateway-box-1-")  # still says where it ran
    assert after.attempt_id.startswith("gateway-box-1-")
