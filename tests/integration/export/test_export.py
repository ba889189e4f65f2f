"""agl-stream export through the real broker and database: rollouts run and rewarded late,
projected, then exported as SFT transcripts (JSONL), RL triplets (Parquet) and preference
pairs, by filter, time range and reward."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow.parquet as pq

from agl_stream.bus.kafka import producer
from agl_stream.bus.streams import EventPublisher, Topics
from agl_stream.commands.rewards import RewardSender
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings
from tests.support.helpers import eventually, invoke_cli
from tests.support.projection import caught_up, ends, projector_in_process
from tests.support.training_traffic import attempt_records, llm_span


def _conversation(rollout_id: str, group: str, answer: str, reward: float) -> list:  # type: ignore[type-arg]
    attempt_id = f"{rollout_id}-a"
    messages = [{"role": "user", "content": f"say {group}"}]
    spans = [
        llm_span(rollout_id, attempt_id, 0, 10, [1, 2], [3], messages=messages, completion="hm",
                 logprobs=[-0.5]),
        llm_span(rollout_id, attempt_id, 1, 20, [1, 2, 3, 4], [5, 6],
                 messages=[*messages, {"role": "assistant", "content": "hm"},
                           {"role": "user", "content": "well?"}],
                 completion=answer, logprobs=[-0.1, -0.2]),
    ]  # fmt: skip
    return attempt_records(rollout_id, spans, attempt_id=attempt_id, reward=reward, group=group)


async def test_datasets_are_exported_by_filter_and_reward(
    kafka: KafkaSettings, database: DatabaseSettings, tmp_path: Path
) -> None:
    records = [
        *_conversation("r1", "x", "x!", 1.0),
        *_conversation("r2", "x", "no", 0.0),
        *_conversation("r3", "x", "x?", 0.5),
        *_conversation("r4", "y", "y!", 0.25),
        *attempt_records("r5", [  # two policies' calls in one attempt
            llm_span("r5", "r5-a", 0, 10, [1, 4], [5], completion="b", policy="speaker"),
            llm_span("r5", "r5-a", 1, 20, [1, 5], [4], completion="a", policy="listener"),
        ], attempt_id="r5-a", reward=1.0, group="z"),
    ]  # fmt: skip
    async with producer(kafka) as prod:
        publisher = EventPublisher(prod, Topics(kafka))
        for (topic, _), event in records:
            await publisher.publish(topic, event)
    async with RewardSender(kafka) as rewards:
        await rewards.send("r2", 0.9, name="thumbs")  # the rollout's
        await rewards.send("r2", 0.1, name="thumbs", attempt_id="r2-a")  # its attempt's wins
        await rewards.send("r4", 0.7, name="thumbs")
    async with projector_in_process(kafka, database):
        wanted = await ends(kafka)
        await eventually(lambda: caught_up(database, wanted), 60, "the projector")

    url = ("--database-url", database.database_url.get_secret_value())
    sft = tmp_path / "sft.jsonl"
    done = await invoke_cli(*url, "export", "--kind", "transcripts", "-o", str(sft),
                            "--metadata", "group=x", "--min-reward", "0.5")  # fmt: skip
    assert done.exit_code == 0, done.output
    assert "exported 2 transcripts from 2 attempts (4 LLM calls)" in done.output
    lines = [json.loads(line) for line in sft.read_text().splitlines()]
    assert [(t["rollout_id"], t["reward"]) for t in lines] == [("r1", 1.0), ("r3", 0.5)]
    assert lines[0]["messages"] == [
        {"role": "user", "content": "say x"}, {"role": "assistant", "content": "hm"},
        {"role": "user", "content": "well?"}, {"role": "assistant", "content": "x!"},
    ]  # fmt: skip

    named = await invoke_cli(*url, "export", "--reward", "thumbs", "--mode", "train")
    assert named.exit_code == 0, named.output
    got = {(t["rollout_id"], t["reward"]) for t in map(json.loads, named.stdout.splitlines())}
    assert got == {("r1", None), ("r2", 0.1), ("r3", None), ("r4", 0.7), ("r5", None)}

    parquet = tmp_path / "triplets.parquet"
    done = await invoke_cli(*url, "export", "--kind", "triplets", "--format", "parquet",
                            "-o", str(parquet))  # fmt: skip
    assert done.exit_code == 0, done.output
    table = pq.read_table(parquet).to_pylist()
    assert len(table) == 10
    first = next(t for t in table if t["rollout_id"] == "r1" and t["call_index"] == 1)
    assert (first["prompt_token_ids"], first["response_token_ids"]) == ([1, 2, 3, 4], [5, 6])
    assert first["response_logprobs"] == [-0.1, -0.2] and first["completion"] == "x!"
    assert first["metadata"] == [("group", "x")] and first["reward"] == 1.0

    by_policy = {
        "listener": [("r5", "a")],
        "speaker": [("r5", "b")],
        "policy": [("r1", "hm"), ("r1", "x!"), ("r3", "hm"), ("r3", "x?")],  # naming none
    }
    for policy, calls in by_policy.items():
        mine = await invoke_cli(*url, "export", "--kind", "triplets", "--policy", policy,
                                "--min-reward", "0.5")  # fmt: skip
        assert mine.exit_code == 0, mine.output
        rows = [json.loads(line) for line in mine.stdout.splitlines()]
        assert [(t["rollout_id"], t["completion"]) for t in rows] == calls, policy

    pairs = await invoke_cli(*url, "export", "--kind", "pairs")
    assert pairs.exit_code == 0, pairs.output
    (pair,) = [json.loads(line) for line in pairs.stdout.splitlines()]
    assert (pair["chosen_rollout_id"], pair["rejected_rollout_id"]) == ("r1", "r2")
    assert pair["chosen"] == [{"role": "assistant", "content": "x!"}]
    assert pair["rejected"] == [{"role": "assistant", "content": "no"}]
    assert pair["prompt"][-1] == {"role": "user", "content": "well?"}

    later = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    none = await invoke_cli(*url, "export", "--since", later)
    assert none.exit_code == 0 and none.stdout == ""
    bad = await invoke_cli(*url, "export", "--format", "parquet")
    assert bad.exit_code == 2 and "give --output" in bad.output
    bad = await invoke_cli(*url, "export", "--since", later, "--until", later)
    assert bad.exit_code == 2 and "--since must be before --until" in bad.output
