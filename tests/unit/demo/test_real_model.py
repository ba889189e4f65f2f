"""The real model's pure parts: what a model spec names, the converted folder's name and
config, the word-problem task and its held-out set, the evaluation's arithmetic, the demo's
settings, and the benchmark's time ratio."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from agl_stream.demo.real import RealSettings, real_config, training_prompts
from agl_stream.demo.word_problems import HELDOUT_SIZE, heldout, score, tasks
from agl_stream.launch.heldout import Evaluation, accuracy, wilson
from agl_stream.training.pretrained import (
    KNOWN_MODELS,
    converted_name,
    is_pretrained,
    parse_spec,
    plain_config,
    resolve_model,
)
from benchmarks.real_model import time_ratio, training_times


def test_a_spec_names_a_known_model_a_gguf_file_or_a_folder(tmp_path: Path) -> None:
    known = parse_spec("smollm2-135m-instruct")
    assert known.kind == "known" and known.known is KNOWN_MODELS["smollm2-135m-instruct"]
    assert parse_spec(str(tmp_path / "m.Q4_1.GGUF")).kind == "gguf"
    assert parse_spec(str(tmp_path)).kind == "folder"
    assert is_pretrained("smollm2-135m-instruct") and not is_pretrained(str(tmp_path))


def test_a_folder_without_a_config_is_refused_with_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()


def test_the_converted_folder_is_named_by_the_content_hash() -> None:
    name = converted_name("SmolLM2 135M/x", "sha256:" + "ab" * 32)
    assert name == "SmolLM2-135M-x-" + "ab" * 8


def test_a_plain_config_has_no_gguf_quantization() -> None:
    loaded = {
        "model_type": "llama", "quantization_config": {"quant_method": "gguf"},
        "_model_name_or_path": "Smollm2 135M 8k", "tie_word_embeddings": True,
    }  # fmt: skip
    plain = plain_config(loaded, "smollm2-135m-instruct")
    assert "quantization_config" not in plain and "_model_name_or_path" not in plain
    assert plain["_name_or_path"] == "smollm2-135m-instruct" and plain["tie_word_embeddings"]
    assert "quantization_config" in loaded  # the input is left as it was


@pytest.mark.parametrize(
    ("answer", "expected", "reward"),
    [
        ("29", 29, 1.0),
        ("Sam has 12 + 17 = 29 apples.", 29, 1.0),
        ("29 apples, or 30", 29, 0.0),  # the last number is the answer
        ("1,029", 1029, 1.0),
        ("twenty-nine", 29, 0.0),
        ("", 29, 0.0),
    ],
)
def test_the_last_number_is_the_answer(answer: str, expected: int, reward: float) -> None:
    assert score(answer, expected) == reward


def test_the_heldout_set_is_fixed_distinct_and_never_trained_on() -> None:
    items = heldout()
    assert len(items) == HELDOUT_SIZE >= 200
    assert items == heldout()  # the same every time
    questions = {i["question"] for i in items}
    assert len(questions) == len(items)
    drawn = tasks(random.Random(0), 2000)
    assert not questions & {t["question"] for t in drawn}
    for item in (*items[:20], *drawn[:20]):
        a, b = (int(w) for w in item["question"].split() if w.isdigit())
        assert item["answer"] == a + b


def test_the_baseline_trains_on_the_driver_s_prompts() -> None:
    """The demo's driver draws each step's tasks from random.Random(seed) in turn."""
    rng = random.Random(3)
    driver = [t for _ in range(5) for t in tasks(rng, 4)]
    assert training_prompts(3, 5, 4) == driver


def test_wilson_interval() -> None:
    low, high = wilson(30, 200)
    assert low == pytest.approx(0.1073, abs=1e-3) and high == pytest.approx(0.2061, abs=1e-3)
    assert wilson(0, 200)[0] == 0.0 and wilson(200, 200)[1] == 1.0
    assert wilson(0, 0) == (0.0, 1.0)


def test_accuracy_counts_failed_rollouts_as_wrong() -> None:
    assert accuracy([1.0, 0.0, None, 1.0]) == (2, 1)


def test_evaluations_are_due_at_the_base_every_n_steps_and_at_the_end() -> None:
    every = Evaluation((), every=10)
    assert [s for s in range(26) if every.due(s, 25)] == [0, 10, 20, 25]
    ends = Evaluation((), every=0)
    assert [s for s in range(26) if ends.due(s, 25)] == [0, 25]


def test_the_real_demo_s_processes_get_its_settings() -> None:
    settings = RealSettings(eval_every=5, heldout_size=200)
    config = real_config(settings, steps=7, run_name="r")
    assert config.init_model == "smollm2-135m-instruct" and config.engine == "vllm"
    assert config.evaluation is not None and len(config.evaluation.items) == 200
    trainer = " ".join(config.trainer_args)
    assert "--lora-rank 16" in trainer and "--temperature 0.7" in trainer
    serve = " ".join(config.serve_args)
    assert "--vllm-lora merge" in serve and "--vllm-max-lora-rank" not in serve
    adapter = " ".join(RealSettings(serve_lora="adapter").serve_args())
    assert "--vllm-lora adapter" in adapter and "--vllm-max-lora-rank 16" in adapter
    assert settings.lr == 3e-4 and "--dtype bfloat16" in trainer
    whole = RealSettings(weights="full")
    assert whole.lr == 3e-5 and "--dtype float32" in " ".join(whole.trainer_args())
    assert "--lora-rank" not in whole.trainer_args()
    assert "--vllm-max-lora-rank" not in whole.serve_args()
    with pytest.raises(ValueError, match="weights"):
        RealSettings(weights="half")
    # What `agl-stream demo --model` passes (its --runners included) overrides the defaults.
    assert real_config(settings, steps=7, runners=2, seed=3).runners == 2


def test_an_evaluation_needs_on_policy_steps() -> None:
    with pytest.raises(ValueError, match="on-policy"):
        real_config(RealSettings(), max_staleness=1)


def test_training_time_leaves_the_evaluations_out() -> None:
    # evaluations ending at 100 (the base), 160 and 230, taking 20, 10 and 30 s
    assert training_times([100.0, 160.0, 230.0], [20.0, 10.0, 30.0]) == [0.0, 50.0, 90.0]


def test_time_ratio_to_trl_s_final_accuracy() -> None:
    ours = [
        {"accuracy": 0.15, "training_s": 0.0},
        {"accuracy": 0.30, "training_s": 300.0},
        {"accuracy": 0.45, "training_s": 600.0},
    ]
    theirs = [{"accuracy": 0.15, "training_s": 0.0}, {"accuracy": 0.40, "training_s": 1200.0}]
    assert time_ratio(ours, theirs) == 0.5
    assert time_ratio(ours[:2], theirs) is None  # never reached
    assert time_ratio([], theirs) is None


def test_the_dashboard_shows_the_heldout_curve_as_a_run_of_its_own() -> None:
    from datetime import UTC, datetime, timedelta

    from agl_stream.dashboard.runs import runs_from_versions
    from agl_stream.queries.models import Resources

    start = datetime(2026, 11, 27, tzinfo=UTC)

    def version(n: int, metadata: dict[str, str]) -> Resources:
        return Resources(
            resources_id=f"v{n}", version=n, resources={}, published_by="demo",
            parent_resources_id=None, metadata=metadata,
            published_at=start + timedelta(seconds=n),
        )  # fmt: skip

    versions = [
        version(1, {"run_name": "r", "step": "0"}),
        version(2, {"heldout_run": "r", "heldout_step": "0", "heldout_accuracy": "0.15",
                    "pin_only": "true"}),
        version(3, {"run_name": "r", "step": "1", "mean_reward": "0.2"}),
        version(4, {"heldout_run": "r", "heldout_step": "1", "heldout_accuracy": "0.4"}),
    ]  # fmt: skip
    runs = {(run.algorithm, run.name): run for run in runs_from_versions(versions)}
    assert set(runs) == {("grpo", "r"), ("heldout", "r")}
    curve = runs[("heldout", "r")].points
    assert [(p.step, p.reward) for p in curve] == [(0, 0.15), (1, 0.4)]
    assert runs[("grpo", "r")].versions == 2  # the held-out versions are not steps


def test_demo_refuses_a_model_that_is_not_one_before_starting_anything(tmp_path: Path) -> None:
    import importlib.util

    from click.testing import CliRunner

    from agl_stream.cli.main import cli

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed: the real demo says so first")
    result = CliRunner().invoke(cli, ["demo", "--model", str(tmp_path), "--no-dashboard"])
    assert result.exit_code == 2, result.output
    assert "is not a model checkpoint (no config.json)" in result.output
