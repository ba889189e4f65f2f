"""A process agent's event URL and key on a real gateway (no broker: what it records stays in
the attempts' recorders): events become spans of their attempt, a bad body is a 400 that names
the problem and records nothing, and each attempt's URLs take its key and no other."""

from __future__ import annotations

import aiohttp
import pytest

from agl_stream.agent.tracing import AttemptRecorder
from agl_stream.gateway.events import BadEvents, parse_events
from agl_stream.gateway.proxy import Gateway
from agl_stream.gateway.routes import attempt_event_url


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"{not json", "not JSON"),
        (b"[]", "empty list"),
        (b'"reward"', "event 0 is not a JSON object"),
        (b'{"type": "score", "value": 1}', "type 'score' is not one of reward, message"),
        (b'{"type": "reward"}', "a reward's value must be a finite number"),
        (b'{"type": "reward", "value": true}', "a reward's value must be a finite number"),
        (b'{"type": "reward", "value": {"a": 1, "b": 2}}', "say which is primary"),
        (b'[{"type": "message", "message": "ok"}, {"type": "message"}]', "event 1: a message"),
        (b'{"type": "annotation", "attributes": [1]}', "an annotation needs an object"),
        (b'{"type": "span", "name": ""}', "a span needs a non-empty string 'name'"),
        (b'{"type": "object", "name": "x"}', "an object needs a 'value'"),
    ],
)
def test_bad_bodies_name_their_problem(body: bytes, problem: str) -> None:
    with pytest.raises(BadEvents, match=problem):
        parse_events(body)


def test_event_fields_beside_the_type_or_under_data() -> None:
    [a, b] = parse_events(
        b'[{"type": "reward", "value": 1}, {"event_type": "reward", "data": {"value": 2}}]'
    )
    assert (a.kind, a.fields["value"], b.kind, b.fields["value"]) == ("reward", 1, "reward", 2)


async def test_each_attempt_takes_its_own_key_and_records_its_own_events() -> None:
    gateway = Gateway()
    url = await gateway.start()
    first, second = AttemptRecorder("ro-1", "at-1"), AttemptRecorder("ro-2", "at-2")
    gateway.open_attempt(first, {}, None, key="key-one")
    gateway.open_attempt(second, {}, None, key="key-two")
    first_url = attempt_event_url(url, "ro-1", "at-1")
    events = [
        {"type": "reward", "value": {"accuracy": 0.5, "length": 3}, "primary": "accuracy"},
        {"type": "message", "message": "hello"},
        {"type": "object", "name": "answer", "value": {"city": "Paris"}},
        {"type": "annotation", "attributes": {"tool": {"name": "search"}}},
        {"type": "span", "name": "tool.search", "attributes": {"hits": 3}},
    ]
    try:
        async with aiohttp.ClientSession() as http:

            async def post(target: str, key: str | None, body: object) -> tuple[int, str]:
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                async with http.post(target, json=body, headers=headers) as response:
                    return response.status, await response.text()

            assert (await post(first_url, None, events))[0] == 401
            status, text = await post(first_url, "key-two", events)  # the other attempt's key
            assert status == 403
            assert "not the key of attempt at-1" in text
            status, text = await post(first_url, "key-one", {"type": "nope"})
            assert status == 400
            assert "is not one of" in text
            assert first.take(0) == []  # nothing of a refused or bad body is recorded
            assert await post(first_url, "key-one", events) == (200, '{"recorded": 5}')
            gone = attempt_event_url(url, "ro-3", "at-3")
            assert (await post(gone, "key-one", events))[0] == 410
            # An OpenAI URL of the attempt refuses the other key too, before any upstream.
            llm_url = f"{url}/rollouts/ro-2/attempts/at-2/llm/v1/chat/completions"
            assert (await post(llm_url, "key-one", {}))[0] == 403
    finally:
        await gateway.stop()
    spans = first.take(0)
    assert [s.name for s in spans] == [
        "agl.reward", "agl.message", "agl.object", "agl.annotation", "tool.search",
    ]  # fmt: skip
    assert first.reward == 0.5
    assert spans[0].attributes["agl.reward.length"] == 3.0
    assert spans[2].attributes["agl.object.json"] == '{"city": "Paris"}'
    assert spans[3].attributes["tool.name"] == "search"
    assert spans[4].attributes["hits"] == 3
    assert second.take(0) == []
