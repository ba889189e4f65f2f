"""Topic definitions as data, and the pure plan of what to create or report."""

from __future__ import annotations

from pathlib import Path

import pytest

from agl_stream.bus.topic_spec import (
    ObservedTopic,
    TopicSpecError,
    load_topic_specs,
    plan_topics,
    readiness_problems,
)
from agl_stream.events import EVENT_TYPES

SPECS = load_topic_specs()


def test_the_design_topics_are_defined() -> None:
    assert set(SPECS) == {"tasks", "rollouts", "spans", "resources", "workers", "dlq"}
    assert SPECS["resources"].cleanup_policy == "compact"
    assert SPECS["workers"].cleanup_policy == "compact"


def test_every_event_type_has_exactly_one_home() -> None:
    homes = [e for spec in SPECS.values() for e in spec.events]
    assert sorted(homes) == sorted(EVENT_TYPES)


def test_lifecycle_topic_is_partitioned_like_tasks() -> None:
    assert SPECS["rollouts"].partitions == SPECS["tasks"].partitions
    assert SPECS["rollouts"].key == SPECS["tasks"].key


def _observed(prefix: str = "agl.", **changes: object) -> dict[str, ObservedTopic]:
    out = {}
    for spec in SPECS.values():
        name = spec.full_name(prefix)
        out[name] = ObservedTopic(name, spec.partitions, 1, spec.configs())
    for name, topic in changes.items():
        if topic is None:
            del out[name]
        else:
            assert isinstance(topic, ObservedTopic)
            out[name] = topic
    return out


def test_plan_on_an_empty_broker_creates_everything() -> None:
    plan = plan_topics(SPECS.values(), {}, "agl.", 1)
    assert {s.name for s in plan.create} == set(SPECS)
    assert plan.drift == ()


def test_plan_on_a_matching_broker_does_nothing() -> None:
    plan = plan_topics(SPECS.values(), _observed(), "agl.", 1)
    assert plan.create == () and plan.drift == ()
    assert len(plan.in_sync) == len(SPECS)


def test_config_drift_is_fixable_and_partition_drift_is_not() -> None:
    observed = _observed()
    observed["agl.tasks"] = ObservedTopic(
        "agl.tasks", 3, 1, {**SPECS["tasks"].configs(), "retention.ms": "1000"}
    )
    plan = plan_topics(SPECS.values(), observed, "agl.", 1)
    settings = {(d.setting, d.fixable) for d in plan.drift}
    assert settings == {("partitions", False), ("retention.ms", True)}


def test_readiness_names_each_problem_and_its_fix() -> None:
    observed = _observed()
    del observed["agl.spans"]
    observed["agl.tasks"] = ObservedTopic("agl.tasks", 3, 1, SPECS["tasks"].configs())
    problems = readiness_problems([SPECS["tasks"], SPECS["spans"]], observed, "agl.", 1)
    assert problems[0] == "topic agl.spans does not exist: run `agl-stream topics apply`"
    assert problems[1].startswith("agl.tasks: partitions is 3, expected 8")
    assert "recreate the topic" in problems[1]


def test_cleanup_policy_drift_blocks_a_worker_but_retention_does_not() -> None:
    observed = _observed()
    configs = {**SPECS["resources"].configs(), "cleanup.policy": "delete", "retention.ms": "5"}
    observed["agl.resources"] = ObservedTopic("agl.resources", 1, 1, configs)
    problems = readiness_problems([SPECS["resources"]], observed, "agl.", 1)
    assert len(problems) == 1
    assert problems[0].startswith("agl.resources: cleanup.policy is delete, expected compact")


def test_prefix_applies() -> None:
    plan = plan_topics(SPECS.values(), _observed(prefix="team-a."), "team-a.", 1)
    assert plan.create == ()


def _write(tmp_path: Path, name: str, text: str) -> Path:
    (tmp_path / f"{name}.toml").write_text(text)
    return tmp_path


BASE = (
    'name = "x"\npartitions = 2\ncleanup_policy = "delete"\nretention_ms = 1\n'
    'compression = "lz4"\nkey = "rollout_id"\n'
)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (BASE + 'events = ["NoSuchEvent"]\n', "unknown event types ['NoSuchEvent']"),
        (BASE.replace('"delete"', '"shred"') + "events = []\n", "cleanup_policy"),
        (BASE + "events = []\nsurprise = 1\n", "surprise"),
        ("name = \n", "x.toml"),
    ],
)
def test_bad_definition_files_name_the_problem(tmp_path: Path, text: str, words: str) -> None:
    with pytest.raises(TopicSpecError) as info:
        load_topic_specs(_write(tmp_path, "x", text))
    assert words in str(info.value)
    assert "x.toml" in str(info.value)


def test_co_partitioning_is_checked(tmp_path: Path) -> None:
    _write(tmp_path, "a", BASE.replace('"x"', '"a"') + "events = []\n")
    _write(
        tmp_path,
        "b",
        BASE.replace('"x"', '"b"').replace("= 2", "= 3")
        + 'events = []\nco_partitioned_with = "a"\n',
    )
    with pytest.raises(TopicSpecError, match="same partitions and key as a"):
        load_topic_specs(tmp_path)


def test_a_deployment_sets_partitions_retention_and_compression(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("tasks", "rollouts", "spans"):
        (tmp_path / f"{name}.toml").write_text(f'name = "{name}"\npartitions = 32\n')
    (tmp_path / "dlq.toml").write_text('retention_ms = 1000\ncompression = "zstd"\n')
    monkeypatch.setenv("AGL_STREAM_TOPICS_DIR", str(tmp_path))
    specs = load_topic_specs()
    assert [specs[n].partitions for n in ("tasks", "rollouts", "spans")] == [32, 32, 32]
    assert (specs["dlq"].retention_ms, specs["dlq"].compression) == (1000, "zstd")
    monkeypatch.delenv("AGL_STREAM_TOPICS_DIR")
    packaged = load_topic_specs()
    assert packaged["tasks"].partitions == 8
    assert specs["workers"] == packaged["workers"]  # what no file names stays as packaged


@pytest.mark.parametrize(
    ("files", "words"),
    [
        ({"tasks.toml": "partitions = 32\n"}, "same partitions and key as tasks"),
        ({"tasks.toml": 'key = "worker_id"\n'}, "key cannot be set per deployment"),
        ({"nope.toml": "partitions = 2\n"}, "overrides topic 'nope', which is not defined"),
        ({"tasks.toml": "partitions = 0\n"}, "partitions"),
    ],
)
def test_bad_overrides_name_the_file_and_setting(
    tmp_path: Path, files: dict[str, str], words: str
) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(TopicSpecError, match=words):
        load_topic_specs(overrides=tmp_path)
