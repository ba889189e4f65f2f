"""Trainer.fit's APO settings, resolved before anything starts (no broker): Agent Lightning's
APO mapped onto agl-stream's argument by argument, what does not map refused naming the
argument, bad settings refused naming the setting; and GRPO's late-reward rule handed to the
trainer process as `worker trainer` takes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

import agl_stream.compat.agl  # noqa: F401  (first: it imports Agent Lightning quietly)
from agl_stream import APO, GRPO, Trainer
from agl_stream.cli.main import cli
from agl_stream.events import LLM, PromptTemplate, TemplateEngine
from agl_stream.launch.fit import FitError
from agl_stream.launch.fit_apo import map_agent_lightning, plan_apo, stream_resources
from agl_stream.training.apo.search import ApoState
from agl_stream.training.trajectories import LateRewardRule, MissingLateReward
from tests.support import fit_agents

import agentlightning as agl  # isort: skip  (after agl_stream.compat.agl)
from agentlightning.algorithm.apo import APO as AglAPO  # isort: skip

ENDPOINT = "http://127.0.0.1:9/v1"
PROMPT = {"prompt": PromptTemplate(template="Answer: {question}")}
NO_ENV: dict[str, str] = {}
KEY = "sk-never-printed"


def agl_apo(**arguments: Any) -> AglAPO[Any]:
    client = arguments.pop("client", None) or openai.AsyncOpenAI(base_url=ENDPOINT, api_key=KEY)
    return AglAPO(client, **arguments)


def test_agent_lightnings_arguments_map_onto_agl_streams() -> None:
    algorithm = agl_apo(
        gradient_model="critic", apply_edit_model="editor", diversity_temperature=0.5,
        gradient_batch_size=6, val_batch_size=10, beam_width=3, branch_factor=5,
        beam_rounds=4, rollout_batch_timeout=90.0,
    )  # fmt: skip
    apo = map_agent_lightning(algorithm, val_size=10)
    assert (apo.rounds, apo.beam_width, apo.branch) == (4, 3, 5)
    assert (apo.train_batch, apo.examples) == (6, 6)  # it critiques every gradient rollout
    assert (apo.critique_model, apo.optimizer_model) == ("critic", "editor")
    assert (apo.temperature, apo.wait_seconds) == (0.5, 90.0)
    assert (apo.optimizer_endpoint, apo.optimizer_api_key) == (ENDPOINT, KEY)
    assert KEY not in repr(apo)


def test_agent_lightnings_defaults_map_too() -> None:
    apo = map_agent_lightning(agl_apo(), val_size=16)
    assert (apo.rounds, apo.beam_width, apo.branch, apo.train_batch) == (3, 4, 4, 4)
    assert (apo.critique_model, apo.optimizer_model) == ("gpt-5-mini", "gpt-4.1-mini")


@pytest.mark.parametrize(
    ("arguments", "val_size", "problem"),
    [
        ({"run_initial_validation": False}, 4,
         r"agl.APO run_initial_validation=False: agl-stream's APO always measures the seed"),
        ({"_poml_trace": True}, 4, r"agl.APO _poml_trace=True: .* not render .* with POML"),
        ({"val_batch_size": 16}, 20,
         r"agl.APO val_batch_size=16: .* whole val_dataset \(20 tasks\); give val_batch_size=20"),
        ({"branch_factor": 0}, 4, r"agl.APO branch_factor=0: must be a whole number, at least 1"),
        ({"beam_rounds": -1}, 4, r"agl.APO beam_rounds=-1: must be a whole number, at least 0"),
        ({"diversity_temperature": -0.5}, 4, r"agl.APO diversity_temperature=-0.5: must be a"),
        ({"rollout_batch_timeout": 0}, 4, r"agl.APO rollout_batch_timeout=0: must be a number"),
        ({"gradient_model": ""}, 4, r"agl.APO gradient_model='': must be a name"),
        ({"client": openai.AsyncAzureOpenAI(api_key="k", api_version="2024-06-01",
                                            azure_endpoint="https://x.openai.azure.com")}, 4,
         r"agl.APO async_openai_client: an Azure client's deployment and api-version"),
        ({"client": openai.AsyncOpenAI(base_url=ENDPOINT, api_key="k", organization="org-1")},
         4, r"agl.APO async_openai_client.organization: .* endpoint and key only"),
    ],
)  # fmt: skip
def test_what_does_not_map_is_refused_naming_the_argument(
    arguments: dict[str, Any], val_size: int, problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        map_agent_lightning(agl_apo(**arguments), val_size)


def test_other_agent_lightning_algorithms_are_refused() -> None:
    with pytest.raises(ValueError, match=r"Agent Lightning's Baseline runs on AglStreamStore"):
        map_agent_lightning(agl.Baseline(), 4)


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"rounds": -1}, r"APO rounds=-1: must be a whole number, at least 0"),
        ({"branch": 0}, r"APO branch=0: must be a whole number, at least 1"),
        ({"beam_width": 1.5}, r"APO beam_width=1.5: must be a whole number"),
        ({"temperature": float("nan")}, r"APO temperature=nan: must be a number, 0 or more"),
        ({"timeout_seconds": 0}, r"APO timeout_seconds=0: must be a number above 0"),
        ({"optimizer_endpoint": "api.openai.com"}, r"optimizer_endpoint='api.openai.com': must"),
        ({"prompt_name": ""}, r"APO prompt_name='': must be a name"),
    ],
)
def test_bad_apo_settings_are_refused_naming_the_setting(
    settings: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        APO(**settings)


def test_the_plan_takes_the_prompt_template_and_the_optimizer() -> None:
    resources = {"llm": LLM(endpoint=ENDPOINT, model="m"), **PROMPT}
    plan = plan_apo(APO(optimizer_endpoint=ENDPOINT + "/"), resources, 3, NO_ENV)
    assert (plan.prompt_name, plan.seed, plan.endpoint) == ("prompt", PROMPT["prompt"], ENDPOINT)
    assert plan.api_key == "not-needed"
    environ = {"OPENAI_BASE_URL": "https://api.example/v1", "OPENAI_API_KEY": "sk-1"}
    plan = plan_apo(APO(), resources, 3, environ)
    assert (plan.endpoint, plan.api_key) == ("https://api.example/v1", "sk-1")
    assert "sk-1" not in repr(plan)
    config = plan.config("state", "run", [{"q": 1}], [{"q": 2}])
    assert (config.seed_template, config.engine, config.prompt_name) == (
        "Answer: {question}", TemplateEngine.F_STRING, "prompt",
    )  # fmt: skip
    assert (config.train_tasks, config.val_tasks, config.run_name) == (
        [{"q": 1}],
        [{"q": 2}],
        "run",
    )


@pytest.mark.parametrize(
    ("algorithm", "resources", "val_size", "environ", "problem"),
    [
        (APO(optimizer_endpoint=ENDPOINT), PROMPT, 0, NO_ENV, r"APO needs val_dataset"),
        (APO(optimizer_endpoint=ENDPOINT), {}, 3, NO_ENV,
         r"APO needs the prompt template it improves in initial_resources"),
        (APO(optimizer_endpoint=ENDPOINT, prompt_name="system"), PROMPT, 3, NO_ENV,
         r"APO prompt_name='system': initial_resources has no prompt template of that name "
         r"\(it has prompt\)"),
        (APO(), PROMPT, 3, NO_ENV, r"APO optimizer_endpoint is not set \(nor OPENAI_BASE_URL\)"),
        (APO(), PROMPT, 3, {"OPENAI_BASE_URL": "localhost:8000"},
         r"OPENAI_BASE_URL='localhost:8000': must be an http"),
        (APO(optimizer_endpoint=ENDPOINT), {"prompt": PromptTemplate(template="{a")}, 3, NO_ENV,
         r"initial_resources\['prompt'\] cannot be optimised"),
        (GRPO(), PROMPT, 3, NO_ENV, r"Trainer.fit runs GRPO\(...\) or APO\(...\), not GRPO"),
        ("apo", PROMPT, 3, NO_ENV, r"not str"),
    ],
)  # fmt: skip
def test_what_an_apo_run_lacks_is_named(
    algorithm: Any, resources: Any, val_size: int, environ: dict[str, str], problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        plan_apo(algorithm, resources, val_size, environ)


def test_agent_lightnings_resources_are_read_as_agl_streams() -> None:
    converted = stream_resources({
        "prompt": agl.PromptTemplate(template="Hi {name}", engine="f-string"),
        "llm": agl.LLM(endpoint=ENDPOINT, model="m", sampling_parameters={"temperature": 0.2}),
        "own": PROMPT["prompt"],
    })  # fmt: skip
    assert converted == {
        "prompt": PromptTemplate(template="Hi {name}", engine=TemplateEngine.F_STRING),
        "llm": LLM(endpoint=ENDPOINT, model="m", sampling_parameters={"temperature": 0.2}),
        "own": PROMPT["prompt"],
    }
    with pytest.raises(ValueError, match=r"'llm'\] is Agent Lightning's ProxyLLM"):
        stream_resources({"llm": agl.ProxyLLM(endpoint=ENDPOINT, model="m")})
    with pytest.raises(ValueError, match=r"'x'\] is a str: give an LLM, a PromptTemplate"):
        stream_resources({"x": "text"})
    with pytest.raises(ValueError, match=r"'llm'\] sampling_parameters.top: "):
        stream_resources({"llm": agl.LLM(endpoint=ENDPOINT, model="m",
                                         sampling_parameters={"top": "high"})})  # fmt: skip


def test_agent_lightnings_apo_tells_its_best_prompt_after_a_fit() -> None:
    from agl_stream.launch.fit_apo import tell_agent_lightning

    state = ApoState(run_id="r-1", prompt_name="prompt", engine="f_string", next_version=1,
                     carried={})  # fmt: skip
    state.add_candidate("Cite a source. {question}", None).rewards = [1.0, 0.5]
    state.beam = ["c0"]
    algorithm = agl_apo()
    tell_agent_lightning(algorithm, state)
    best = algorithm.get_best_prompt()
    assert (best.template, best.engine) == ("Cite a source. {question}", "f-string")


def test_fit_refuses_bad_apo_settings_before_starting_anything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No stack is configured: had fit gone on, it would have started the embedded one."""
    monkeypatch.delenv("AGL_STREAM_BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.delenv("AGL_CURRENT_ROLE", raising=False)
    tasks = [{"name": "a", "expected": "hello a"}]
    cases = [
        (Trainer(algorithm=agl_apo(run_initial_validation=False), initial_resources=PROMPT),
         r"agl.APO run_initial_validation=False"),
        (Trainer(algorithm=APO(), initial_resources=PROMPT), r"optimizer_endpoint is not set"),
        (Trainer(algorithm=agl_apo(), initial_resources={"p": agl.ProxyLLM(endpoint=ENDPOINT,
                                                                            model="m")}),
         r"initial_resources\['p'\] is Agent Lightning's ProxyLLM"),
        (Trainer(algorithm="grpo"), r"Trainer.fit runs GRPO\(...\) or APO\(...\), not str"),
        (Trainer(algorithm=agl_apo()), r"APO needs the prompt template it improves"),
    ]  # fmt: skip
    for trainer, problem in cases:
        with pytest.raises(FitError, match=problem):
            trainer.fit(fit_agents.greeter, train_dataset=tasks, val_dataset=tasks)


def test_agent_lightnings_apo_brings_its_own_initial_resources() -> None:
    algorithm = agl_apo()
    algorithm.set_initial_resources({"prompt": agl.PromptTemplate(template="{q}", engine="jinja")})
    trainer = Trainer(algorithm=algorithm)
    assert trainer._resources() == {"prompt": PromptTemplate(template="{q}", engine="jinja")}


def test_grpo_hands_its_late_reward_rule_to_the_trainer_as_worker_trainer_takes_it(
    tmp_path: Path,
) -> None:
    assert GRPO().trainer_args() == ()
    rule = LateRewardRule("thumbs", wait_seconds=12.5, missing=MissingLateReward.FINAL)
    args = GRPO(late_reward=rule).trainer_args()
    assert args == ("--late-reward", "thumbs", "--late-reward-wait", "12.5",
                    "--late-reward-missing", "final")  # fmt: skip
    # The trainer worker's own options parse them into the same rule.
    from agl_stream.cli.train import trainer_config

    command = cli.commands["worker"].commands["trainer"]  # type: ignore[attr-defined]
    context = command.make_context("trainer", ["--checkpoint-dir", str(tmp_path), *args])
    assert trainer_config(**context.params).late_reward == rule
    with pytest.raises(ValueError, match=r"GRPO late_reward must be a LateRewardRule"):
        GRPO(late_reward="thumbs")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"late-reward rule needs the reward's name"):
        LateRewardRule("")


def test_a_stall_under_a_dropping_rule_says_why() -> None:
    dropping = GRPO(late_reward=LateRewardRule("thumbs", wait_seconds=30))
    assert "drops a trajectory whose reward did not come within 30 s" in dropping.stall_hint()
    assert (
        GRPO(late_reward=LateRewardRule("thumbs", missing=MissingLateReward.FINAL)).stall_hint()
        == ""
    )
    assert GRPO().stall_hint() == ""
