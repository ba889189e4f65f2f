"""The resources rule's pure part: what a new version holds and how a repeat is found."""

from __future__ import annotations

import pytest

from agl_stream.commands.resources import (
    Change,
    ResourceCache,
    ResourcesConflict,
    already_published,
    next_version,
)
from agl_stream.events import LLM, PromptTemplate, ResourcesPublished
from agl_stream.events.resources import PIN_ONLY

PROMPT = PromptTemplate(template="Say {x}")
ENDPOINT = LLM(endpoint="http://127.0.0.1:1/v1", model="policy")


def _cache(*events: ResourcesPublished) -> ResourceCache:
    cache = ResourceCache()
    for event in events:
        cache.apply(event)
    return cache


def test_a_new_version_is_numbered_above_all_and_carries_the_latest() -> None:
    base = ResourcesPublished(resources_id="a", version=4, resources={"llm": ENDPOINT})
    candidate = ResourcesPublished(
        resources_id="cand", version=5, resources={"prompt": PromptTemplate(template="no")},
        metadata={PIN_ONLY: "true"},
    )  # fmt: skip
    cache = _cache(base, candidate)
    event = next_version(cache, Change(resources={"prompt": PROMPT}, id_prefix="run"), "me")
    assert (event.resources_id, event.version) == ("run-v6", 6)  # above the candidate too
    assert event.resources == {"llm": ENDPOINT, "prompt": PROMPT}  # the latest's, not the pin's
    assert event.parent_resources_id == "a"
    assert event.published_by == "me"


def test_a_version_may_carry_nothing_and_be_pin_only() -> None:
    cache = _cache(ResourcesPublished(resources_id="a", version=0, resources={"llm": ENDPOINT}))
    change = Change(resources={"prompt": PROMPT}, resources_id="c1", carry=False, pin_only=True)
    event = next_version(cache, change, "apo")
    assert event.resources == {"prompt": PROMPT}
    assert event.pin_only
    cache.apply(event)
    assert cache.latest is not None and cache.latest.resources_id == "a"
    assert next_version(_cache(), Change(resources={"prompt": PROMPT}), "x").version == 0


def test_publishing_an_id_again_finds_it_or_is_refused() -> None:
    cache = _cache(
        ResourcesPublished(
            resources_id="p", version=3, resources={"prompt": PROMPT, "llm": ENDPOINT}
        )
    )
    same = Change(resources={"prompt": PROMPT}, resources_id="p")
    found = already_published(cache, same)
    assert found is not None and found.version == 3
    other = Change(resources={"prompt": PromptTemplate(template="Other {x}")}, resources_id="p")
    with pytest.raises(ResourcesConflict, match="p is already published with other resources"):
        already_published(cache, other)
    assert already_published(cache, Change(resources={"prompt": PROMPT}, resources_id="q")) is None


def test_a_change_without_an_id_is_recognised_and_a_taken_id_is_not_reused() -> None:
    mine = ResourcesPublished(
        resources_id="run-v0", version=0, resources={"prompt": PROMPT}, metadata={"step": "1"}
    )
    cache = _cache(mine)
    again = Change(
        resources={"prompt": PROMPT}, id_prefix="run", same_as=lambda v: v.metadata == {"step": "1"}
    )
    assert already_published(cache, again) is mine
    by_hand = ResourcesPublished(resources_id="run-v2", version=1, resources={"llm": ENDPOINT})
    cache.apply(by_hand)
    fresh = next_version(cache, Change(resources={"prompt": PROMPT}, id_prefix="run"), "t")
    assert fresh.version == 2
    assert fresh.resources_id.startswith("run-v2-") and fresh.resources_id != "run-v2"
    pinned = Change(resources={"prompt": PROMPT}, resources_id="run-v0", pin_only=True)
    with pytest.raises(ResourcesConflict):
        already_published(cache, pinned)
