"""Triplets, transcripts, advantages, the staleness rule, batches and lineage checks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agl_stream.commands.resources import Change, ResourceCache, next_version
from agl_stream.events import AttemptStatus, Checkpoint, SpanStatus, StatusCode
from agl_stream.training.advantages import group_advantages
from agl_stream.training.batching import Groups, Staleness, StalePolicy, build_step, policy_step
from agl_stream.training.checkpoints import CheckpointStore, lineage_problems
from agl_stream.training.trajectories import Trajectory
from agl_stream.training.triplets import (
    RewardRule,
    build_transcript,
    build_triplets,
    finetune_jsonl,
    policy_reward,
)
from tests.support.training_traffic import llm_span, reward_span, span

HASH = "sha256:" + "0" * 64


def trajectory(
    spans: list,
    reward: float | None = 1.0,
    group: str = "g",
    rid: str = "r",
    resources_id: str = "v1",
) -> Trajectory:  # type: ignore[type-arg]
    return Trajectory(
        rollout_id=rid, attempt_id="a", attempt_number=1, input_json="{}",
        metadata={"group": group}, resources_id=resources_id, status=AttemptStatus.SUCCEEDED,
        reward=reward, spans=tuple(spans),
    )  # fmt: skip


def multi_turn(reward: float = 1.0) -> Trajectory:
    """A three-turn agent: call, intermediate reward, call, tool span, call, final reward."""
    m1 = [{"role": "user", "content": "hi"}]
    m2 = [*m1, {"role": "assistant", "content": "A"}, {"role": "user", "content": "more"}]
    m3 = [*m2, {"role": "assistant", "content": "B"}, {"role": "user", "content": "last"}]
    return trajectory([
        llm_span("r", "a", 0, 10, [1, 2], [3], messages=m1, completion="A", logprobs=[-1.0]),
        reward_span("r", "a", 1, 20, 0.5),
        llm_span("r", "a", 2, 30, [1, 2, 3, 4], [5, 6], messages=m2, completion="B"),
        span("r", "a", 3, "tool.search", 40),
        llm_span("r", "a", 4, 50, [1, 2, 3, 4, 5, 6, 7], [8], messages=m3, completion="C"),
        reward_span("r", "a", 5, 60, reward),
    ], reward=reward)  # fmt: skip


def test_final_rule_gives_every_call_the_final_reward() -> None:
    adapted = build_triplets(multi_turn(0.75))
    assert [t.reward for t in adapted.triplets] == [0.75, 0.75, 0.75]
    assert [t.prompt_ids for t in adapted.triplets] == [(1, 2), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7)]
    assert [t.response_ids for t in adapted.triplets] == [(3,), (5, 6), (8,)]
    assert adapted.triplets[0].logprobs == (-1.0,)
    assert adapted.triplets[1].logprobs is None
    assert adapted.problems == []


def test_per_call_rule_gives_each_reward_to_the_call_before_it() -> None:
    adapted = build_triplets(multi_turn(0.75), RewardRule.PER_CALL)
    assert [t.reward for t in adapted.triplets] == [0.5, 0.0, 0.75]


def test_discounted_rule() -> None:
    adapted = build_triplets(multi_turn(1.0), RewardRule.DISCOUNTED, gamma=0.5)
    assert [t.reward for t in adapted.triplets] == [0.25, 0.5, 1.0]


def test_calls_without_token_ids_are_reported_not_dropped_silently() -> None:
    t = trajectory([
        llm_span("r", "a", 0, 10, [1], [2]),
        llm_span("r", "a", 1, 20, None, [3]),
        llm_span("r", "a", 2, 30, [1], None),
    ])  # fmt: skip
    adapted = build_triplets(t)
    assert len(adapted.triplets) == 1
    reasons = [str(p) for p in adapted.problems]
    assert reasons == [
        f"rollout r attempt a span {2:016x}: LLM call 1 has no prompt token ids",
        f"rollout r attempt a span {3:016x}: LLM call 2 has no response token ids",
    ]


def test_attempt_without_llm_calls_or_reward_is_a_problem() -> None:
    assert [p.reason for p in build_triplets(trajectory([])).problems] == ["no LLM call spans"]
    no_reward = trajectory([llm_span("r", "a", 0, 1, [1], [2])], reward=None)
    assert "no reward" in build_triplets(no_reward).problems[0].reason


def test_transcript_is_the_conversation_with_answers_and_exports_as_jsonl() -> None:
    transcript = build_transcript(multi_turn(0.9))
    assert [m["content"] for m in transcript.messages] == ["hi", "A", "more", "B", "last", "C"]
    assert transcript.reward == 0.9
    lines = finetune_jsonl([transcript, build_transcript(multi_turn(0.1))], min_reward=0.5)
    [line] = lines.splitlines()
    assert json.loads(line)["messages"][-1] == {"role": "assistant", "content": "C"}


def test_group_advantages() -> None:
    adv = group_advantages([1.0, 0.0, 0.5, 0.5, 3.0], ["a", "a", "b", "b", "c"])
    assert adv[0] == pytest.approx(1.0, abs=1e-4) and adv[1] == pytest.approx(-1.0, abs=1e-4)
    assert adv[2:] == [0.0, 0.0, 0.0]  # equal rewards, and a group of one, say nothing
    assert group_advantages([1.0, 0.0], ["a", "a"], scale=False) == [0.5, -0.5]
    with pytest.raises(ValueError, match="not a finite number"):
        group_advantages([math.nan], ["a"])


@given(st.lists(st.floats(-100, 100), min_size=1, max_size=20), st.integers(1, 4))
def test_advantages_of_each_group_sum_to_zero(rewards: list[float], groups: int) -> None:
    labels = [i % groups for i in range(len(rewards))]
    adv = group_advantages(rewards, labels)
    for g in range(groups):
        assert sum(a for a, label in zip(adv, labels, strict=True) if label == g) == pytest.approx(
            0, abs=1e-6
        )


def test_staleness_rule() -> None:
    assert Staleness().weight(None, 10) == 1.0  # no bound: every sample counts
    bound = Staleness(max_versions=1)
    assert bound.weight(9, 10) == 1.0
    assert bound.weight(8, 10) is None
    assert bound.weight(None, 10) is None  # unknown policy: too stale to trust
    soft = Staleness(max_versions=1, policy=StalePolicy.DOWNWEIGHT, decay=0.5)
    assert soft.weight(7, 10) == 0.25
    with pytest.raises(ValueError, match="0 or more"):
        Staleness(max_versions=-1)


def test_groups_fill_then_step_takes_the_oldest_full_ones() -> None:
    groups = Groups(group_size=2, groups_per_step=2)
    groups.add([trajectory([], group="x", rid="1"), trajectory([], group="y", rid="2")])
    assert not groups.ready()
    groups.add(
        [
            trajectory([], group="y", rid="3"),
            trajectory([], group="x", rid="4"),
            trajectory([], group="x", rid="5"),
        ]
    )
    assert groups.ready()
    taken = groups.take()
    assert [[t.rollout_id for t in g] for g in taken] == [["1", "4"], ["2", "3"]]
    assert groups.waiting() == 1  # x's third waits for the next x


def test_build_step_drops_stale_and_computes_advantages_per_group() -> None:
    def t(rid: str, reward: float, version: str) -> Trajectory:
        return trajectory(
            [llm_span(rid, "a", 0, 1, [1], [2])], reward=reward, rid=rid, resources_id=version
        )

    groups = [[t("1", 1.0, "v5"), t("2", 0.0, "v5"), t("3", 1.0, "v2")]]
    step = build_step(groups, {"v5": 5, "v2": 2}, 5, Staleness(max_versions=1))
    assert step.counts["dropped_stale"] == 1
    assert [s.key[0] for s in step.samples] == ["1", "2"]
    assert step.samples[0].advantage > 0 > step.samples[1].advantage
    assert sorted(k[0] for k in step.used) == ["1", "2", "3"]  # the stale one is consumed too
    assert step.mean_reward == 0.5


def test_lineage_problems() -> None:
    def state(step: int, cut: dict, consumed: dict, used: list) -> dict:  # type: ignore[type-arg]
        return {"step": step, "cut": cut, "consumed": consumed, "used": used}

    good = [
        state(0, {"spans:0": 0}, {}, []),
        state(1, {"spans:0": 5}, {"spans:0": [0, 5]}, [["r", "a"]]),
        state(2, {"spans:0": 9}, {"spans:0": [5, 9]}, [["r", "b"]]),
    ]
    assert lineage_problems(good) == []
    overlap = [*good[:2], state(2, {"spans:0": 9}, {"spans:0": [4, 9]}, [["r", "a"]])]
    problems = lineage_problems(overlap)
    assert "step 2: spans:0 starts at 4, step 1 ended at 5" in problems
    assert "step 2: attempt a was already used by step 1" in problems


def test_stale_trajectories_leave_their_groups_so_fresh_groups_fill_the_step() -> None:
    groups = Groups(group_size=2, groups_per_step=1)
    old = trajectory([], group="old", rid="1", resources_id="v1")
    groups.add([old, trajectory([], group="new", rid="2", resources_id="v3")])
    groups.add([trajectory([], group="old", rid="3", resources_id="v1")])
    evicted = groups.evict(lambda t: t.resources_id == "v1")
    assert [t.rollout_id for t in evicted] == ["1", "3"]
    assert not groups.ready() and groups.waiting() == 1


def test_past_the_bound_the_oldest_groups_that_are_not_full_leave() -> None:
    groups = Groups(group_size=2, groups_per_step=1, max_waiting=3)
    groups.add([trajectory([], group=g, rid=r) for g, r in [("a", "1"), ("b", "2"), ("b", "3")]])
    assert groups.overflow() == []  # three waiting: at the bound
    groups.add([trajectory([], group="c", rid="4"), trajectory([], group="d", rid="5")])
    # Five waiting: the oldest group that is not full (a) and the next one (c) leave; b is
    # full and older than both but waits for its step.
    assert [t.rollout_id for t in groups.overflow()] == ["1", "4"]
    assert groups.waiting() == 3 and groups.ready()
    assert [[t.rollout_id for t in g] for g in groups.take()] == [["2", "3"]]
    with pytest.raises(ValueError, match="cannot hold one step"):
        Groups(group_size=4, groups_per_step=2, max_waiting=7)


def test_failed_calls_are_not_trained_on() -> None:
    """A call the gateway recorded as failed (the upstream died mid-answer) gave the agent
    nothing; the retry that answered is the triplet."""
    failed = llm_span("r", "a", 0, 10, None, None).model_copy(
        update={"status": SpanStatus(code=StatusCode.ERROR, description="upstream failed")}
    )
    adapted = build_triplets(trajectory([failed, llm_span("r", "a", 1, 20, [1], [2])]))
    assert [t.response_ids for t in adapted.triplets] == [(2,)]
    assert adapted.problems == []


def two_policies(reward: float, rid: str = "r") -> Trajectory:
    """A speaker's call, then a listener's, then the rollout's one reward."""
    return trajectory([
        llm_span(rid, "a", 0, 10, [1, 4], [5], policy="speaker"),
        llm_span(rid, "a", 1, 20, [1, 5], [4], policy="listener"),
        llm_span(rid, "a", 2, 25, [1, 6], [7]),  # names no policy: the default one's
        reward_span(rid, "a", 3, 30, reward),
    ], reward=reward, rid=rid)  # fmt: skip


def test_each_policy_takes_only_its_own_calls_and_shares_the_reward() -> None:
    for policy, prompt in (("speaker", (1, 4)), ("listener", (1, 5)), ("policy", (1, 6))):
        adapted = build_triplets(two_policies(0.5), policy=policy)
        assert [(t.prompt_ids, t.reward) for t in adapted.triplets] == [(prompt, 0.5)], policy
    assert len(build_triplets(two_policies(0.5)).triplets) == 3  # no policy named: every call
    missing = build_triplets(two_policies(0.5), policy="judge")
    assert [str(p) for p in missing.problems] == [
        "rollout r attempt a: no LLM call spans of policy 'judge'"
    ]


def test_a_policys_step_has_one_sample_per_trajectory_with_the_groups_advantages() -> None:
    groups = [[two_policies(1.0, "r1"), two_policies(0.0, "r2")]]
    for policy in ("speaker", "listener"):
        step = build_step(groups, {"v1": 0}, 0, Staleness(), policy=policy)
        assert [s.key[0] for s in step.samples] == ["r1", "r2"]
        assert [s.advantage > 0 for s in step.samples] == [True, False]
        assert step.counts["trajectories"] == 2 and step.rewards == [1.0, 0.0]


def test_a_reward_naming_a_policy_is_that_policys_alone() -> None:
    """The speaker is rewarded for its own part; the listener takes the rollout's reward."""
    t = trajectory([
        llm_span("r", "a", 0, 10, [1, 4], [5], policy="speaker"),
        reward_span("r", "a", 1, 15, 0.25, policy="speaker"),
        llm_span("r", "a", 2, 20, [1, 5], [4], policy="listener"),
        reward_span("r", "a", 3, 30, 0.75, policy="speaker"),  # its last: its final reward
        reward_span("r", "a", 4, 40, 1.0),
    ], reward=1.0)  # fmt: skip
    for policy, final in (("speaker", 0.75), ("listener", 1.0)):
        (triplet,) = build_triplets(t, policy=policy).triplets
        assert triplet.reward == final, policy
        assert policy_reward(t, policy) == final
    # Per call: each call takes the rewards after it that name its policy or none (the
    # rollout's, shared), never another policy's.
    per_call = {
        p: [x.reward for x in build_triplets(t, RewardRule.PER_CALL, policy=p).triplets]
        for p in ("speaker", "listener")
    }
    assert per_call == {"speaker": [0.25 + 0.75 + 1.0], "listener": [1.0]}
    assert policy_reward(t, "judge") == 1.0  # no reward of its own: the rollout's


def test_staleness_is_counted_in_the_trained_policys_own_updates(tmp_path: Path) -> None:
    """Two trainers and a driver publish side by side (each version on top of the latest, as
    the topic would have them): a speaker sample is as stale as the speaker updates since its
    checkpoint, however many versions the listener's trainer or anyone else published."""
    stores = {p: CheckpointStore(str(tmp_path / p)) for p in ("speaker", "listener")}
    cache = ResourceCache()

    def publish(prefix: str, **steps: int) -> str:
        held = {p: Checkpoint(uri=stores[p].uri(s), content_hash=HASH) for p, s in steps.items()}
        event = next_version(cache, Change(resources=held, id_prefix=prefix), "test")
        cache.apply(event)
        return event.resources_id

    publish("speaker", speaker=0)
    publish("listener", listener=0)  # carries the speaker's step 0
    joint = publish("joint", speaker=0, listener=0)
    for step in range(1, 6):
        publish("listener", listener=step)  # five listener updates, the speaker's carried
    on_listener_5 = publish("speaker", speaker=1)  # the listener's step 5 carried
    publish("speaker", speaker=2)
    elsewhere = Checkpoint(uri=(tmp_path / "copy").as_uri(), content_hash=HASH)
    foreign = next_version(cache, Change(resources={"speaker": elsewhere}), "test")
    cache.apply(foreign)

    def steps_held(policy: str) -> dict[str, int]:
        found = {
            rid: policy_step(v.resources, policy, stores[policy].step_of)
            for rid, v in cache.versions.items()
        }
        return {rid: step for rid, step in found.items() if step is not None}

    def sample(rid: str, version: str, reward: float) -> Trajectory:
        calls = [llm_span(rid, "a", 0, 1, [1], [2], policy="speaker"),
                 llm_span(rid, "a", 1, 2, [2], [3], policy="listener")]  # fmt: skip
        return trajectory(calls, reward=reward, rid=rid, resources_id=version)

    groups = [
        [sample("j1", joint, 1.0), sample("j2", joint, 0.0)],
        [sample("s1", on_listener_5, 1.0), sample("f1", foreign.resources_id, 0.0)],
    ]
    speaker = steps_held("speaker")
    assert foreign.resources_id not in speaker  # not the speaker trainer's checkpoint
    # The joint version is 7 versions behind the newest, 2 speaker updates: within a bound of
    # 2; the sample whose speaker checkpoint is unknown is too stale to trust.
    bound = Staleness(max_versions=2)
    step = build_step(groups, speaker, 2, bound, policy="speaker")
    assert [s.key[0] for s in step.samples] == ["j1", "j2", "s1"]
    assert step.counts["dropped_stale"] == 1 and "downweighted_stale" not in step.counts
    # One speaker update later the joint version's samples are past the bound.
    later = build_step(groups, speaker, 3, bound, policy="speaker")
    assert [s.key[0] for s in later.samples] == ["s1"] and later.counts["dropped_stale"] == 3
    soft = Staleness(max_versions=2, policy=StalePolicy.DOWNWEIGHT)
    weights = {
        s.key[0]: s.weight for s in build_step(groups, speaker, 3, soft, policy="speaker").samples
    }
    assert weights == {"j1": 0.5, "j2": 0.5, "s1": 1.0}
    # The listener judges the same samples by its own updates: the joint version holds its
    # step 0, five behind; the speaker's versions carry its step 5.
    listener = steps_held("listener")
    assert listener[joint] == 0 and listener[on_listener_5] == listener[foreign.resources_id] == 5
    theirs = build_step(groups, listener, 5, bound, policy="listener")
    assert [s.key[0] for s in theirs.samples] == ["f1", "s1"]
    assert theirs.counts["dropped_stale"] == 2
