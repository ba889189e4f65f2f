"""APO's pure parts: templates, what it asks the optimizer and how it reads the answers,
the beam, task sampling, and its state file."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from agl_stream.cli.main import cli
from agl_stream.commands.resources import ResourceCache
from agl_stream.events import PIN_ONLY, PromptTemplate, ResourcesPublished, TemplateEngine
from agl_stream.events.templates import TemplateError, placeholders, render
from agl_stream.training.apo.prompts import (
    MAX_MESSAGE_CHARS,
    Example,
    check_candidate,
    critique_messages,
    read_candidate,
    rewrite_messages,
)
from agl_stream.training.apo.search import (
    ApoState,
    Candidate,
    sample_tasks,
    select_beam,
    tasks_digest,
    worst,
)

# -- templates -------------------------------------------------------------------------------


def test_fstring_placeholders_and_rendering() -> None:
    template = "Q: {question} ({task.kind}, {items[0]}) {{literal}}"
    assert placeholders(template) == {"question", "task", "items"}
    prompt = PromptTemplate(template="Hello {name}!")
    assert prompt.format(name="Ada") == "Hello Ada!"
    assert prompt.placeholders() == {"name"}


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        ("{}", "has no name"),
        ("{0}", "has no name"),
        ("unclosed {brace", "not a valid f-string template"),
        ("stray } brace", "not a valid f-string template"),
    ],
)
def test_unreadable_fstring_templates_say_why(template: str, problem: str) -> None:
    with pytest.raises(TemplateError, match=problem):
        placeholders(template)


def test_rendering_names_missing_values() -> None:
    with pytest.raises(TemplateError, match=r"no value for placeholder.*city"):
        render("{name} from {city}", "f_string", {"name": "Ada"})


def test_jinja_templates() -> None:
    prompt = PromptTemplate(template="Hi {{ name }}{% if x %}!{% endif %}", engine="jinja")
    assert prompt.placeholders() == {"name", "x"}
    assert prompt.format(name="Ada", x=True) == "Hi Ada!"
    with pytest.raises(TemplateError, match="not a valid jinja template"):
        placeholders("{% if %}", "jinja")


def test_poml_is_stored_but_not_rendered_here() -> None:
    prompt = PromptTemplate(template="<poml/>", engine=TemplateEngine.POML)
    with pytest.raises(TemplateError, match="render them with the poml package"):
        prompt.format()


# -- pin-only versions ------------------------------------------------------------------------


def _version(rid: str, version: int, pin_only: bool = False) -> ResourcesPublished:
    return ResourcesPublished(
        resources_id=rid, version=version, resources={"prompt": PromptTemplate(template=rid)},
        metadata={PIN_ONLY: "true"} if pin_only else {},
    )  # fmt: skip


def test_a_pin_only_version_never_becomes_the_latest() -> None:
    cache = ResourceCache()
    for event in (_version("v1", 1), _version("cand", 5, pin_only=True), _version("v2", 2)):
        cache.apply(event)
    assert cache.latest is not None
    assert cache.latest.resources_id == "v2"
    assert cache.resolve("cand").resources_id == "cand"  # type: ignore[union-attr]


# -- asking the optimizer ---------------------------------------------------------------------


def test_critique_shows_template_inputs_conversations_rewards_and_errors() -> None:
    long = "x" * (MAX_MESSAGE_CHARS * 2)
    examples = [
        Example(
            {"q": 1},
            ({"role": "user", "content": "hi"}, {"role": "assistant", "content": long}),
            0.25,
        ),
        Example({"q": 2}, (), None, "ValueError: bad"),
    ]  # fmt: skip
    system, user = critique_messages("Say {q}", examples)
    assert system["role"] == "system"
    text = user["content"]
    assert "<template>\nSay {q}\n</template>" in text
    assert 'Task input: {"q": 1}' in text
    assert "[assistant] " in text
    assert "...[truncated]" in text
    assert len(text) < 2 * MAX_MESSAGE_CHARS + 1000
    assert "Reward: 0.25" in text
    assert "Reward: none (the attempt failed)" in text
    assert "Error: ValueError: bad" in text
    assert "made no LLM call" in text


def test_rewrite_request_names_the_placeholders_and_the_variant() -> None:
    _, user = rewrite_messages("Say {q} to {who}", "- be kind", {"who", "q"}, 1, 3)
    assert "Placeholders to keep: {q}, {who}." in user["content"]
    assert "rewrite 2 of 3" in user["content"]
    assert "<critique>\n- be kind\n</critique>" in user["content"]


@pytest.mark.parametrize(
    ("answer", "template"),
    [
        ("Sure!\n<template>\nNew {q}\n</template>\nHope it helps", "New {q}"),
        ("Here:\n```text\nFenced {q}\n```", "Fenced {q}"),
        ("  Bare {q}  ", "Bare {q}"),
        ("<template>Inline {q}</template>", "Inline {q}"),
    ],
)
def test_read_candidate(answer: str, template: str) -> None:
    assert read_candidate(answer) == template


@pytest.mark.parametrize(
    ("candidate", "reason"),
    [
        ("Better {q}", None),
        ("", "held no template"),
        ("Say {q}", "the same template"),
        ("Earlier {q}", "the same template"),
        ("No placeholder", "dropped {q}"),
        ("{q} and {extra}", "added {extra}"),
        ("{q} {", "not a valid f-string"),
        ("{q}" + "x" * 20_001, "over 20,000"),
    ],
)
def test_check_candidate(candidate: str, reason: str | None) -> None:
    found = check_candidate(candidate, "Say {q}", "f_string", {"Say {q}", "Earlier {q}"})
    if reason is None:
        assert found is None
    else:
        assert found is not None
        assert reason in found


# -- the beam and its memory ------------------------------------------------------------------


def _candidate(
    cid: str, rewards: list[float | None] | None, rejected: str | None = None
) -> Candidate:
    return Candidate(cid, "t", None, 0, 0, f"r-{cid}", rejected, rewards)


def test_beam_keeps_the_best_measured_and_ties_go_to_the_older() -> None:
    candidates = [
        _candidate("c0", [0.5, 0.5]),
        _candidate("c1", [1.0, None]),  # a failed rollout counts 0: mean 0.5, ties with c0
        _candidate("c2", [0.9, 0.8]),
        _candidate("c3", None),  # not measured
        _candidate("c4", [1.0], rejected="dropped {q}"),
        _candidate("c10", [0.5, 0.5]),  # ties too; numbered after c1, not before
    ]
    assert select_beam(candidates, 3) == ["c2", "c0", "c1"]
    assert select_beam(candidates, 10) == ["c2", "c0", "c1", "c10"]


def test_worst_puts_failed_attempts_first() -> None:
    results = [("a", 0.5), ("b", None), ("c", 0.1), ("d", 1.0)]
    assert worst(results, 3) == ["b", "c", "a"]


def test_tasks_digest_names_the_task_sets() -> None:
    digest = tasks_digest([{"q": 1}], [{"q": 2}])
    assert digest == tasks_digest([{"q": 1}], [{"q": 2}])
    assert digest != tasks_digest([{"q": 2}], [{"q": 1}])
    assert digest != tasks_digest([{"q": 1}], [{"q": 2}, {"q": 3}])


def test_task_samples_are_stable_and_differ_by_round_and_parent() -> None:
    first = sample_tasks(100, 8, seed=0, round_=1, parent="c0")
    assert first == sample_tasks(100, 8, seed=0, round_=1, parent="c0")
    assert len(set(first)) == 8
    assert first != sample_tasks(100, 8, seed=0, round_=2, parent="c0")
    assert first != sample_tasks(100, 8, seed=0, round_=1, parent="c1")
    assert sample_tasks(5, 8, seed=0, round_=1, parent="c0") == [0, 1, 2, 3, 4]


def test_state_round_trips_and_numbers_versions_only_for_valid_candidates() -> None:
    state = ApoState(run_id="apo-1", prompt_name="prompt", engine="f_string", next_version=7,
                     carried={"llm": {"endpoint": "http://x/v1", "model": "m"}})  # fmt: skip
    seed = state.add_candidate("Say {q}", None)
    bad = state.add_candidate("Say", "c0", rejected="dropped {q}")
    good = state.add_candidate("Kindly say {q}", "c0")
    assert (seed.version, good.version, state.next_version) == (7, 8, 9)
    assert bad.rejected
    assert good.resources_id == "apo-1-c2"
    seed.rewards = [0.5, None]
    state.beam = ["c0"]
    state.critiques["1:c0"] = "- be kind"
    again = ApoState.from_json(state.to_json())
    assert again == state
    assert again.best() == seed
    assert again.children(0, "c0") == [bad, good]


# -- the command line -------------------------------------------------------------------------


def _apo(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["worker", "trainer", "--algorithm", "apo", *args], env={})
    return result.exit_code, result.output


def test_cli_refuses_apo_without_what_it_needs(tmp_path: pytest.TempPathFactory) -> None:
    code, out = _apo()
    assert code == 2
    assert "--checkpoint-dir" in out
    code, out = _apo("--checkpoint-dir", "/tmp/x")
    assert code == 2
    assert "--optimizer-endpoint" in out
    base = ("--checkpoint-dir", "/tmp/x", "--optimizer-endpoint", "http://127.0.0.1:9/v1")
    code, out = _apo(*base)
    assert code == 2
    assert "--train-tasks" in out
    code, out = _apo(*base, "--prompt", "Say {", "--rounds", "0", "--val-tasks", "/nonexistent")
    assert code == 2
    assert "not a valid f-string template" in out
    code, out = _apo(*base, "--prompt", "@/nonexistent/seed.txt")
    assert code == 2
    assert "cannot read /nonexistent/seed.txt" in out


def test_cli_asks_critiques_of_the_critique_model(tmp_path: Path) -> None:
    from agl_stream.cli.apo import apo_config

    tasks = tmp_path / "val.jsonl"
    tasks.write_text('{"question": "q"}\n')
    command = cli.commands["worker"].commands["trainer"]  # type: ignore[attr-defined]
    base = ("--algorithm", "apo", "--checkpoint-dir", str(tmp_path), "--rounds", "0",
            "--val-tasks", str(tasks), "--optimizer-endpoint", "http://127.0.0.1:9/v1")  # fmt: skip
    params = command.make_context("trainer", list(base)).params
    assert apo_config(params).critique_model is None  # the optimizer model's then
    params = command.make_context("trainer", [*base, "--critique-model", "critic"]).params
    assert apo_config(params).critique_model == "critic"


@pytest.mark.parametrize(
    "args",
    [
        ("worker", "trainer", "--algorithm", "apo", "--train-tasks", "a\x00b"),
        (
            "worker",
            "trainer",
            "--algorithm",
            "apo",
            "--checkpoint-dir",
            "/tmp/x",
            "--optimizer-endpoint",
            "http://h/v1",
            "--prompt",
            "@a\x00b",
        ),
        ("enqueue", "a\x00b"),
        ("down", "--home", "\x00"),
        ("demo", "--out", "\x00"),
    ],
)
def test_a_nul_in_a_path_is_refused_with_a_sentence(args: tuple[str, ...]) -> None:
    result = CliRunner().invoke(cli, list(args), env={})
    assert result.exit_code == 2, result.output
    assert "NUL" in result.output or "cannot read" in result.output


def test_retrain_refuses_apo() -> None:
    result = CliRunner().invoke(
        cli, ["retrain", "--algorithm", "apo", "--checkpoint-dir", "/tmp/x"], env={}
    )
    assert result.exit_code == 2
    assert "runs online only" in result.output


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        ((), "say what to publish"),
        (("--llm", "llm"), "is not NAME=VALUE"),
        (("--llm", "llm=http://h/v1"), "is not NAME=ENDPOINT@MODEL"),
        (("--llm", "llm=ftp://h@m"), "is not an http(s) URL"),
        (("--prompt", "p=Say {"), "p: not a valid f-string template"),
        (("--prompt", "p=@/nonexistent.txt"), "cannot read /nonexistent.txt"),
        (("--prompt", "p={{ x", "--engine", "jinja"), "p: not a valid jinja template"),
        (("--prompt", "p=x", "--metadata", "nokey"), "is not KEY=VALUE"),
    ],
)
def test_resources_publish_refuses_bad_input(args: tuple[str, ...], problem: str) -> None:
    result = CliRunner().invoke(cli, ["resources", "publish", "v1", *args], env={})
    assert result.exit_code == 2
    assert problem in result.output
