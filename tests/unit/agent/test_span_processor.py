"""The span processor's memory: spans an agent never ends are forgotten with its attempt."""

from __future__ import annotations

import gc

from opentelemetry.sdk.trace import TracerProvider

from agl_stream.agent.tracing import AttemptRecorder, AttemptSpanProcessor, current_recorder


def test_spans_that_never_end_are_forgotten_with_their_attempt() -> None:
    processor = AttemptSpanProcessor()
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("test")
    for i in range(50):
        recorder = AttemptRecorder("ro", f"attempt-{i}")
        token = current_recorder.set(recorder)
        try:
            with tracer.start_as_current_span("root"):
                tracer.start_span("left open")  # never ended
                with tracer.start_span("done"):
                    pass
        finally:
            current_recorder.reset(token)
        assert [e.name for e in recorder.take(0)] == ["done", "root"]
        recorder.close()
    assert processor.open_spans() <= 1  # only the last attempt's, while it is referenced
    del recorder
    gc.collect()
    assert processor.open_spans() == 0
