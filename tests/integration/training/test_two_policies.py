"""Two policies trained together, a trainer each (`worker trainer --policy`), on the attempts
of one agent that calls both: kill -9 one trainer again and again while both train. The
killed one goes on from its latest checkpoint (records after its cut read again, the attempts
it trained on skipped); the other never notices: each lineage shows every consumed offset
range once and every attempt trained on exactly once, each version names only its own
policy's checkpoint in its own directory, and the ids and consumer groups of the two never
mix. Each judges staleness in its own policy's updates: versions published in between, by the
other trainer or anyone else, do not make its samples stale. The listener's policy is also
called by a third agent, a judge, whose calls its trainer leaves out (`--agent-match`, Agent
Lightning's agent_match), as does an offline retrain with the same match. A projector projects
the run as it goes: a replay of the topics into a new read model gives the same answers, each
policy's lineage among them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
from asyncio.subprocess import Process
from pathlib import Path

import pytest

from agl_stream.agent.llm import LLM_CALL_SPAN, POLICY
from agl_stream.bus.kafka import admin_client
from agl_stream.commands.resources import Change, publish_resources
from agl_stream.events import AttemptStatus, Checkpoint, Resource
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings
from agl_stream.training.agent_match import calling_agent
from agl_stream.training.checkpoints import CheckpointStore, lineage_problems
from agl_stream.training.retrain import resolve_range
from agl_stream.training.trainer import Trainer, TrainerConfig, trainer_group
from tests.integration.training.test_trainer import published
from tests.support.helpers import eventually, invoke_cli
from tests.support.projection import caught_up, ends, projector_in_process, replay_differences
from tests.support.runs import history, queue, runner_in_process, trainer_process

pytestmark = pytest.mark.slow

GROUPS, GROUP_SIZE, GROUPS_PER_STEP = 24, 4, 4  # 96 attempts, 6 steps a policy
POLICIES = ("speaker", "listener")
AGENT = "tests.support.agents:two_policies_echo"
# Every attempt runs on both policies' step 0: the samples of step n are n - 1 updates of
# the policy behind, past each bound from some step on (down-weighted, so that steps go on).
MAX_STALENESS = {"speaker": 2, "listener": 4}
# The agents whose calls each trainer trains (the agent also calls the listener's policy
# from a judge agent).
AGENT_MATCH = {"speaker": "speaker", "listener": "^listener$"}


def trained(store: CheckpointStore) -> list[tuple[str, str]]:
    return [(k[0], k[1]) for s in store.lineage() for k in s["used"]]


async def test_one_policys_trainer_killed_leaves_the_other_training(
    kafka: KafkaSettings, database: DatabaseSettings, tmp_path: Path
) -> None:
    rng = random.Random(11)
    stores = {p: CheckpointStore(str(tmp_path / p)) for p in POLICIES}
    logs = {p: tmp_path / f"{p}.log" for p in POLICIES}

    async def start(policy: str, seed: int) -> Process:
        return await trainer_process(
            kafka, stores[policy].root, logs[policy], "two", GROUP_SIZE, GROUPS_PER_STEP,
            "--policy", policy, "--seed", str(seed),
            "--max-staleness", str(MAX_STALENESS[policy]), "--stale-policy", "downweight",
            "--agent-match", AGENT_MATCH[policy],
        )  # fmt: skip

    trainers = {p: await start(p, seed) for seed, p in enumerate(POLICIES, start=1)}
    listener = trainers["listener"]
    kills = 0
    live = contextlib.AsyncExitStack()  # the read model, projected while the run goes on
    await live.enter_async_context(projector_in_process(kafka, database))
    try:

        async def firsts() -> dict[str, Resource]:
            return {
                e.metadata["policy"]: e.resources[e.metadata["policy"]]
                for e in await published(kafka)
                if e.metadata.get("run_name") == "two" and e.metadata.get("step") == "0"
            }

        async def both_first() -> bool:
            return set(await firsts()) == set(POLICIES)

        await eventually(both_first, 90, "both trainers to publish their first version")
        # The attempts run on one version holding both policies' first checkpoints.
        joint = Change(resources=await firsts(), id_prefix="two-joint", carry=False)
        version = await publish_resources(kafka, joint, published_by="test")
        # Newer versions that hold no newer checkpoint (someone publishing each policy's
        # first one again): the topic's version numbers run ahead, the policies' do not.
        for _ in range(3):
            for policy, first in (await firsts()).items():
                again = Change(resources={policy: first}, id_prefix="two-copy", carry=False)
                await publish_resources(kafka, again, published_by="test")
        async with runner_in_process(kafka, AGENT, concurrency=8):
            for g in range(GROUPS):
                await queue(
                    kafka, [{"letter": "abcde"[g % 5]}] * GROUP_SIZE,
                    metadata={"group": f"two-{g}"}, resources_id=version.resources_id,
                )  # fmt: skip
            for _ in range(2):
                steps_before = len(stores["speaker"].steps())

                async def progressed(n: int = steps_before) -> bool:
                    return len(stores["speaker"].steps()) > n

                await eventually(progressed, 120, "the speaker's trainer to make a step")
                await asyncio.sleep(rng.uniform(0, 1.0))  # anywhere: mid-update, mid-write
                trainers["speaker"].send_signal(signal.SIGKILL)
                await trainers["speaker"].wait()
                kills += 1
                trainers["speaker"] = await start("speaker", 1)

            async def all_trained() -> bool:
                return all(len(trained(s)) >= GROUPS * GROUP_SIZE for s in stores.values())

            await eventually(all_trained, 240, "both trainers to train on every attempt")
            h = await history(kafka)
        versions = await published(kafka)
        async with admin_client(kafka) as admin:
            groups = {g[0] for g in await admin.list_consumer_groups()}
        run = await ends(kafka)
        await eventually(lambda: caught_up(database, run), 60, "the run in the read model")
    finally:
        for trainer in trainers.values():
            if trainer.returncode is None:
                trainer.send_signal(signal.SIGTERM)
                await asyncio.wait_for(trainer.wait(), 60)
        await live.aclose()

    assert kills == 2 and listener.returncode == 0  # stopped by the test, never killed
    succeeded = {
        (a.rollout_id, a.attempt_id)
        for finished in h.finished.values()
        for a in finished
        if a.status == AttemptStatus.SUCCEEDED
    }
    assert len(succeeded) == GROUPS * GROUP_SIZE
    for policy, store in stores.items():
        states = store.lineage()
        assert lineage_problems(states) == [], logs[policy].read_text()[-3000:]
        used = trained(store)
        assert len(used) == len(set(used)) == GROUPS * GROUP_SIZE and set(used) == succeeded
        assert {s["policy"] for s in states} == {policy}
        # The ranges start where the run started (the topics' beginning).
        assert all(start == 0 for start, _ in states[1]["consumed"].values())
        # Its own agent's calls only: one a trajectory (not the judge's of the listener).
        assert all(s["counts"]["samples"] == GROUPS_PER_STEP * GROUP_SIZE for s in states[1:])
        assert len(states) == 1 + GROUPS // GROUPS_PER_STEP  # step 0, then one per step
        # Stale in its own updates only: step n trains on samples n - 1 updates behind.
        stale = [s["counts"].get("downweighted_stale", 0) for s in states[1:]]
        assert stale == [
            GROUPS_PER_STEP * GROUP_SIZE if n - 1 > MAX_STALENESS[policy] else 0
            for n in range(1, len(states))
        ], policy
        assert all(s["counts"].get("dropped_stale", 0) == 0 for s in states), policy
        own = [v for v in versions if v.metadata.get("policy") == policy]
        assert [int(v.metadata["step"]) for v in own] == list(range(len(states)))
        assert all(v.resources_id.startswith(f"two-{policy}-v") for v in own)
        # Each of its versions holds its own checkpoint, from its own directory.
        for v in own:
            mine = v.resources[policy]
            assert isinstance(mine, Checkpoint) and store.step_of(mine.uri) is not None
        assert trainer_group(kafka.topic_prefix, policy) in groups

    await _check_replay(kafka, database, 1 + GROUPS // GROUPS_PER_STEP)

    # Each attempt called the listener's policy twice, from the listener agent and from the
    # judge; its trainer trained one call a trajectory (above): the listener agent's.
    for _, attempt_id in succeeded:
        spans = {s.span_id: s for s in h.spans[attempt_id]}
        calls = [s for s in spans.values() if s.name == LLM_CALL_SPAN]
        listeners = [s for s in calls if s.attributes.get(POLICY) == "listener"]
        assert sorted(str(calling_agent(s, spans)) for s in listeners) == ["judge", "listener"]

    # One policy retrained offline from the topics: its own agent's calls of every attempt.
    start, until = await resolve_range(kafka, {}, {})
    offline = TrainerConfig(
        checkpoint_dir=str(tmp_path / "offline"), run_name="offline", policy="listener",
        agent_match=AGENT_MATCH["listener"],
        group_size=GROUP_SIZE, groups_per_step=GROUPS_PER_STEP, publish=False, start=start,
        until=until,
    )  # fmt: skip
    await asyncio.wait_for(Trainer(kafka, offline).run(asyncio.Event()), 120)
    again = CheckpointStore(offline.checkpoint_dir).lineage()
    assert (
        lineage_problems(again) == []
        and set(trained(CheckpointStore(offline.checkpoint_dir))) == succeeded
    )
    assert all(s["counts"]["samples"] == GROUPS_PER_STEP * GROUP_SIZE for s in again[1:])


async def _check_replay(kafka: KafkaSettings, database: DatabaseSettings, lineage: int) -> None:
    """The topics replayed into a new read model give the live one's answers: every rollout
    with its attempts and spans, every version, and each policy's lineage as `agl-stream
    query resources --policy NAME` shows it."""
    differ, rebuilt = await replay_differences(kafka, database, name="rebuilt")
    rollouts = set(rebuilt) - {"resources", "workers"}
    assert differ == [] and len(rollouts) == GROUPS * GROUP_SIZE, differ[:5]
    url = ("--database-url", database.database_url.get_secret_value())
    for policy in POLICIES:
        shown = []
        for model in ((), ("--read-model", "rebuilt")):
            args = ("query", "resources", "--policy", policy, "--json")
            result = await invoke_cli(*url, *args, *model)
            assert result.exit_code == 0, result.output
            shown.append(json.loads(result.output))
        live, again = shown
        assert len(live) == lineage and again == live, policy
        assert [v["parent_resources_id"] for v in live[:-1]] == [
            v["resources_id"] for v in live[1:]
        ]  # newest first: each names the one before
