"""APO through `Trainer.fit`: agl-stream's APO (training/apo) configured by its own
`APO(...)` or by Agent Lightning's `agl.APO(...)`, whose arguments are mapped where they
correspond and refused, by name, where they do not; and Agent Lightning's resources
(`agl.PromptTemplate`, `agl.LLM`) read as agl-stream's. Pure code: fit.py runs it."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from agl_stream.events import LLM, Checkpoint, PromptTemplate, TemplateEngine
from agl_stream.events.resources import Resource
from agl_stream.events.templates import TemplateError
from agl_stream.training.apo.optimizer import ApoConfig
from agl_stream.training.apo.search import ApoState

AGL_ENGINES = {
    "f-string": TemplateEngine.F_STRING,
    "jinja": TemplateEngine.JINJA,
    "poml": TemplateEngine.POML,
}


@dataclass(frozen=True)
class APO:
    """Prompt optimisation (agl-stream's APO) of the prompt template in the Trainer's
    initial_resources: round 0 measures it on val_dataset, each later round critiques every
    template of the beam on train_batch training tasks and measures branch rewrites."""

    rounds: int = 3
    beam_width: int = 2
    branch: int = 2
    train_batch: int = 8  # training tasks each template runs on before its critique
    examples: int = 4  # of those attempts, the worst shown to the critic
    optimizer_endpoint: str | None = None  # None: OPENAI_BASE_URL
    optimizer_model: str = "gpt-4.1-mini"  # writes the rewrites (and critiques, by default)
    critique_model: str | None = None  # None: optimizer_model
    optimizer_api_key: str | None = field(default=None, repr=False)  # None: OPENAI_API_KEY
    temperature: float = 1.0
    max_tokens: int = 1024  # of each critique or rewrite
    prompt_name: str | None = None  # None: the first prompt template in initial_resources
    timeout_seconds: float | None = None  # per attempt; None: no bound
    wait_seconds: float = 1800.0  # per batch of rollouts
    seed: int = 0

    def __post_init__(self) -> None:
        for name, rule in _RULES.items():
            problem = rule(getattr(self, name))
            if problem is not None:
                raise ValueError(f"APO {name}={getattr(self, name)!r}: {problem}")


def _at_least(low: int) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
        return None if ok else f"must be a whole number, at least {low}"

    return check


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _positive(value: Any) -> str | None:
    return None if _number(value) and value > 0 else "must be a number above 0"


def _non_negative(value: Any) -> str | None:
    return None if _number(value) and value >= 0 else "must be a number, 0 or more"


def _name(value: Any) -> str | None:
    return None if isinstance(value, str) and value else "must be a name"


def _endpoint(value: Any) -> str | None:
    if isinstance(value, str) and value.startswith(("http://", "https://")):
        return None
    return "must be an http:// or https:// URL"


def _optional(check: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    return lambda value: None if value is None else check(value)


# What each setting must be: a sentence's end, or None when it is fine.
_RULES: dict[str, Callable[[Any], str | None]] = {
    "rounds": _at_least(0), "beam_width": _at_least(1), "branch": _at_least(1),
    "train_batch": _at_least(1), "examples": _at_least(1), "max_tokens": _at_least(1),
    "seed": _at_least(0), "temperature": _non_negative, "wait_seconds": _positive,
    "timeout_seconds": _optional(_positive), "optimizer_endpoint": _optional(_endpoint),
    "optimizer_model": _name, "critique_model": _optional(_name),
    "prompt_name": _optional(_name),
}  # fmt: skip


# -- Agent Lightning's APO ---------------------------------------------------------------------

# agl.APO's argument -> the APO field it sets (gradient_batch_size sets train_batch and
# examples: Agent Lightning critiques every rollout of its gradient batch).
AGL_ARGUMENTS = {
    "beam_rounds": "rounds", "beam_width": "beam_width", "branch_factor": "branch",
    "gradient_batch_size": "train_batch", "diversity_temperature": "temperature",
    "rollout_batch_timeout": "wait_seconds", "gradient_model": "critique_model",
    "apply_edit_model": "optimizer_model",
}  # fmt: skip


def from_agent_lightning(algorithm: Any) -> bool:
    """Whether `algorithm` is one of Agent Lightning's (its class lives in agentlightning)."""
    return type(algorithm).__module__.split(".")[0] == "agentlightning"


def map_agent_lightning(algorithm: Any, val_size: int) -> APO:
    """agl.APO(...) as agl-stream's APO; ValueError names the argument that does not map."""
    from agentlightning.algorithm.apo import APO as AglAPO  # imported: `algorithm` is one

    if not isinstance(algorithm, AglAPO):
        raise ValueError(
            f"Trainer.fit runs GRPO and APO; Agent Lightning's {type(algorithm).__name__} runs "
            "on AglStreamStore with Agent Lightning's own Trainer"
        )

    def refuse(argument: str, why: str) -> ValueError:
        return ValueError(f"agl.APO {argument}: {why}")

    if not algorithm.run_initial_validation:
        raise refuse(
            "run_initial_validation=False",
            "agl-stream's APO always measures the seed template first: its score is what a "
            "rewrite must beat",
        )
    if algorithm._poml_trace:
        raise refuse(
            "_poml_trace=True",
            "agl-stream's APO does not render its requests with POML: there is no trace to write",
        )
    if algorithm.val_batch_size < val_size:
        raise refuse(
            f"val_batch_size={algorithm.val_batch_size}",
            f"agl-stream's APO measures every candidate on the whole val_dataset ({val_size} "
            f"tasks); give val_batch_size={val_size} or more, or a smaller val_dataset",
        )
    values = {field_: getattr(algorithm, argument) for argument, field_ in AGL_ARGUMENTS.items()}
    for argument, field_ in AGL_ARGUMENTS.items():
        problem = _RULES[field_](values[field_])
        if problem is not None:
            raise refuse(f"{argument}={values[field_]!r}", problem)
    endpoint, api_key = _client(algorithm.async_openai_client, refuse)
    return APO(
        **values, examples=values["train_batch"], optimizer_endpoint=endpoint,
        optimizer_api_key=api_key,
    )  # fmt: skip


def _client(client: Any, refuse: Callable[[str, str], ValueError]) -> tuple[str, str | None]:
    """The endpoint and key of the optimizer's openai client; what it cannot carry over is
    refused rather than dropped."""
    import openai

    argument = "async_openai_client"
    if isinstance(client, openai.AsyncAzureOpenAI):
        raise refuse(
            argument,
            "an Azure client's deployment and api-version do not carry over to agl-stream's "
            "APO; give an openai.AsyncOpenAI client",
        )
    if not isinstance(client, openai.AsyncOpenAI):
        raise refuse(argument, f"needs an openai.AsyncOpenAI client, not {type(client).__name__}")
    for setting in ("organization", "project"):
        if getattr(client, setting, None):
            raise refuse(
                f"{argument}.{setting}",
                "agl-stream's APO sends the client's endpoint and key only, not its "
                f"{setting}: leave it unset",
            )
    return str(client.base_url).rstrip("/"), client.api_key or None


def tell_agent_lightning(algorithm: Any, state: ApoState) -> None:
    """Agent Lightning's APO answers get_best_prompt() after a fit, as after its own
    Trainer's: it keeps the best in these attributes (0.3), set here from the run's."""
    from agentlightning.types import PromptTemplate as AglPromptTemplate

    best = state.best()
    if best is None:
        return
    engine = {v: k for k, v in AGL_ENGINES.items()}[TemplateEngine(state.engine)]
    algorithm._history_best_prompt = AglPromptTemplate(template=best.template, engine=engine)
    algorithm._history_best_score = best.score
    algorithm._history_best_version = best.resources_id


# -- resources ---------------------------------------------------------------------------------


def stream_resources(resources: Mapping[str, Any]) -> dict[str, Resource]:
    """The Trainer's initial_resources as agl-stream's resources: its own pass; Agent
    Lightning's LLM and PromptTemplate are read as agl-stream's; anything else is refused."""
    out: dict[str, Resource] = {}
    for name, value in resources.items():
        if isinstance(value, LLM | PromptTemplate | Checkpoint):
            out[name] = value
            continue
        kind = getattr(value, "resource_type", None) if from_agent_lightning(value) else None
        try:
            if kind == "prompt_template":
                engine = AGL_ENGINES[value.engine]
                out[name] = PromptTemplate(template=value.template, engine=engine)
            elif kind == "llm":
                out[name] = LLM(
                    endpoint=value.endpoint,
                    model=value.model,
                    sampling_parameters=value.sampling_parameters,
                )
            elif kind == "proxy_llm":
                raise ValueError(
                    f"initial_resources[{name!r}] is Agent Lightning's ProxyLLM, which points at "
                    "its LLMProxy: give an LLM with the model's own endpoint (each runner's "
                    "gateway plays the proxy's part)"
                )
            else:
                raise ValueError(
                    f"initial_resources[{name!r}] is a {type(value).__name__}: give an LLM, a "
                    "PromptTemplate or a Checkpoint (agl-stream's, or Agent Lightning's LLM "
                    "and PromptTemplate)"
                )
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"initial_resources[{name!r}] {where}: {first['msg']}") from None
    return out


# -- the run's plan ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ApoPlan:
    """An APO run resolved before anything starts: its settings, the template it improves
    and the optimizer it asks."""

    apo: APO
    prompt_name: str
    seed: PromptTemplate
    endpoint: str
    api_key: str = field(repr=False)

    def config(self, state_dir: str, run_name: str, train: list[Any], val: list[Any]) -> ApoConfig:
        apo = self.apo
        return ApoConfig(
            state_dir=state_dir, train_tasks=train, val_tasks=val,
            optimizer_endpoint=self.endpoint, optimizer_model=apo.optimizer_model,
            optimizer_api_key=self.api_key, critique_model=apo.critique_model,
            prompt_name=self.prompt_name, seed_template=self.seed.template,
            engine=self.seed.engine, run_name=run_name, rounds=apo.rounds,
            beam_width=apo.beam_width, branch=apo.branch, train_batch=apo.train_batch,
            examples=apo.examples, temperature=apo.temperature, max_tokens=apo.max_tokens,
            rollout_timeout=apo.timeout_seconds, wait_seconds=apo.wait_seconds, seed=apo.seed,
        )  # fmt: skip


def plan_apo(
    algorithm: Any,
    resources: Mapping[str, Resource],
    val_size: int,
    environ: Mapping[str, str] = os.environ,
) -> ApoPlan:
    """The plan of an APO fit (agl-stream's APO or Agent Lightning's); ValueError says what
    is missing or wrong, naming the setting."""
    apo = map_agent_lightning(algorithm, val_size) if from_agent_lightning(algorithm) else algorithm
    if not isinstance(apo, APO):
        raise ValueError(f"Trainer.fit runs GRPO(...) or APO(...), not {type(algorithm).__name__}")
    if val_size == 0:
        raise ValueError("APO needs val_dataset: it measures every template on it")
    templates = [name for name, value in resources.items() if isinstance(value, PromptTemplate)]
    name = apo.prompt_name or (templates[0] if templates else None)
    if name is None:
        raise ValueError(
            "APO needs the prompt template it improves in initial_resources, e.g. "
            "initial_resources={'prompt': PromptTemplate(template='Answer: {question}')}"
        )
    seed = resources.get(name)
    if not isinstance(seed, PromptTemplate):
        raise ValueError(
            f"APO prompt_name={name!r}: initial_resources has no prompt template of that name "
            f"(it has {', '.join(templates) or 'none'})"
        )
    try:
        seed.placeholders()
    except TemplateError as exc:
        raise ValueError(f"initial_resources[{name!r}] cannot be optimised: {exc}") from None
    endpoint = apo.optimizer_endpoint or environ.get("OPENAI_BASE_URL")
    if not endpoint:
        raise ValueError(
            "APO optimizer_endpoint is not set (nor OPENAI_BASE_URL): the OpenAI-compatible "
            "endpoint that writes critiques and rewrites"
        )
    problem = _endpoint(endpoint)
    if problem is not None:
        raise ValueError(f"OPENAI_BASE_URL={endpoint!r}: {problem}")
    api_key = apo.optimizer_api_key or environ.get("OPENAI_API_KEY") or "not-needed"
    return ApoPlan(apo, name, seed, endpoint.rstrip("/"), api_key)
