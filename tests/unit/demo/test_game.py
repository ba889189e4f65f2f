"""The referential game's rules, with fixed samplers (no model), and the two-policy driver's
pure parts: pairing the trainers' versions and the joint version it publishes."""

from __future__ import annotations

import random
from datetime import UTC, datetime

from agl_stream.dashboard.runs import runs_from_versions
from agl_stream.demo.game import (
    joint_reward,
    listener_prompt,
    play,
    score,
    speaker_prompt,
    tasks,
)
from agl_stream.demo.task import LETTERS
from agl_stream.demo.two_policies import Pairing, TwoPolicyConfig, joint_change, joint_step
from agl_stream.events import Checkpoint, ResourcesPublished
from agl_stream.queries.models import Resources
from agl_stream.training.model import tiny_policy

CODE = {"a": "c", "b": "d", "c": "e", "d": "a", "e": "b"}  # the speaker's word for a letter


def test_the_listener_scores_only_the_letter() -> None:
    assert score("a", "a") == 1.0
    assert score("a", " a ") == 1.0
    assert score("a", "b") == 0.0
    assert score("a", "") == 0.0
    assert score("a", "<eos>") == 0.0


def test_prompts() -> None:
    assert speaker_prompt("c") == "<bos> c"
    assert listener_prompt("d") == "<bos> d"
    assert listener_prompt(" d ") == "<bos> d"
    assert listener_prompt("") == "<bos>"
    assert listener_prompt("  ") == "<bos>"


def test_a_shared_code_wins_every_game() -> None:
    decode = {word: letter for letter, word in CODE.items()}
    heard: list[str] = []

    def speak(prompt: str) -> str:
        return f" {CODE[prompt.split()[-1]]}"

    def listen(prompt: str) -> str:
        heard.append(prompt)
        return decode[prompt.split()[-1]]

    for letter in LETTERS:
        game = play(letter, speak, listen)
        assert (game.word, game.answer, game.reward) == (CODE[letter], letter, 1.0)
    assert heard == [f"<bos> {CODE[letter]}" for letter in LETTERS]


def test_the_listener_hears_only_the_word() -> None:
    """A listener that echoes what it hears wins only where the speaker echoes the letter."""

    def listen(prompt: str) -> str:
        return prompt.split()[-1]

    assert play("a", lambda prompt: "a", listen).reward == 1.0
    assert play("a", lambda prompt: "b", listen).reward == 0.0
    silent = play("a", lambda prompt: "", listen)
    assert (silent.word, silent.answer, silent.reward) == ("", "<bos>", 0.0)


def test_tasks_are_letters_drawn_from_the_rng() -> None:
    drawn = tasks(random.Random(3), 20)
    assert drawn == tasks(random.Random(3), 20)
    assert {t["letter"] for t in drawn} <= set(LETTERS)


def test_the_joint_reward_is_seeded() -> None:
    speaker, listener = tiny_policy(1), tiny_policy(2)
    first = joint_reward(speaker, listener, random.Random(5), 50)
    assert first == joint_reward(speaker, listener, random.Random(5), 50)
    assert 0.0 <= first <= 1.0


def _version(rid: str, policy: str, step: int, run: str = "r", **extra: str) -> ResourcesPublished:
    checkpoint = Checkpoint(
        uri=f"file:///c/{policy}/step-{step}", content_hash="sha256:" + f"{step:064x}"
    )
    return ResourcesPublished(
        resources_id=rid, version=int(rid.rsplit("v", 1)[1]), resources={policy: checkpoint},
        published_by="trainer", parent_resources_id=None,
        metadata={"policy": policy, "step": str(step), "run_name": run, **extra},
    )  # fmt: skip


def test_a_step_is_ready_when_both_trainers_published_it() -> None:
    pairing = Pairing("r")
    pairing.add(_version("r-speaker-v1", "speaker", 0))
    pairing.add(_version("x-listener-v2", "listener", 0, run="x"))  # another run's
    assert pairing.ready(0) is None
    pairing.add(_version("r-listener-v3", "listener", 0))
    pair = pairing.ready(0)
    assert pair is not None and {p: v.resources_id for p, v in pair.items()} == {
        "speaker": "r-speaker-v1",
        "listener": "r-listener-v3",
    }
    assert pairing.ready(1) is None


def test_the_joint_version_holds_the_two_checkpoints_alone() -> None:
    config = TwoPolicyConfig(run_name="r")
    pairing = Pairing("r")
    pairing.add(_version("r-speaker-v4", "speaker", 1, mean_reward="0.25", samples="64"))
    pairing.add(_version("r-listener-v5", "listener", 1, mean_reward="0.25", samples="64"))
    pair = pairing.ready(1)
    assert pair is not None
    change = joint_change(config, 1, pair)
    assert change.resources == {
        "speaker": pairing.checkpoint("speaker", 1),
        "listener": pairing.checkpoint("listener", 1),
    }
    assert not change.carry and change.id_prefix == "r-joint"
    # Not a trainer's version: no run_name and step (the dashboard would make it a run).
    assert change.metadata == {
        "joint_run": "r",
        "joint_step": "1",
        "speaker_resources_id": "r-speaker-v4",
        "listener_resources_id": "r-listener-v5",
    }
    joint = Resources(
        resources_id="r-joint-v6", version=6, resources={}, published_by="demo",
        parent_resources_id=None, metadata=dict(change.metadata), published_at=datetime.now(UTC),
    )  # fmt: skip
    assert runs_from_versions([joint]) == []  # the dashboard's runs are the trainers' alone
    point = joint_step(1, pair, "r-joint-v6")
    assert point.mean_reward == 0.25 and point.resources_id == "r-joint-v6"
    assert point.points["speaker"].samples == 64
    assert point.points["listener"].resources_id == "r-listener-v5"
