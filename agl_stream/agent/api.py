"""Agents: plain functions (sync or async) decorated with @rollout, or LitAgent subclasses."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import traceback
import warnings
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from agl_stream.agent.threads import run_sync
from agl_stream.events import LLM, Checkpoint, PromptTemplate, RolloutMode

NamedResources = Mapping[str, LLM | PromptTemplate | Checkpoint]
# Resource types by name, for agents whose annotations are strings (from __future__ import).
_RESOURCE_TYPES = {"LLM": LLM, "PromptTemplate": PromptTemplate, "Checkpoint": Checkpoint}
AgentResult = float | int | None


@dataclass(frozen=True)
class Rollout:
    """The identity of the attempt an agent runs in."""

    rollout_id: str
    attempt_id: str
    attempt_number: int
    mode: RolloutMode
    resources_id: str | None
    metadata: Mapping[str, str] = field(default_factory=dict)
    # Where the agent POSTs events on the runner's gateway, and the attempt's key (set when
    # the agent runs outside the runner's process: a process agent).
    event_url: str | None = None
    key: str | None = field(default=None, repr=False)


class LitAgent:
    """Base class for stateful agents: override `rollout` (sync) or `rollout_async`."""

    # True: the agent runs outside the runner's process, so its attempt's gateway URLs
    # require the attempt's key (given on `Rollout.key`).
    keyed_gateway: ClassVar[bool] = False
    trained_agents: str | None = None

    def __init__(self, *, trained_agents: str | None = None) -> None:
        # Agent Lightning's LitAgent took the agents to train (deprecated there in 0.3 for its
        # adapter's agent_match). Runners do not train: kept, with a warning saying where the
        # choice is made here, so that a moved agent still runs.
        self.trained_agents = trained_agents
        if trained_agents is not None:
            warnings.warn(
                f"LitAgent(trained_agents={trained_agents!r}) does nothing in a runner: the "
                f"trainer picks the agents whose calls it trains, `agl-stream worker trainer "
                f"--agent-match {trained_agents!r}`",
                UserWarning,
                stacklevel=2,
            )

    def rollout(self, task: Any, resources: NamedResources, rollout: Rollout) -> AgentResult:
        raise NotImplementedError(f"{type(self).__name__} must implement rollout or rollout_async")

    async def rollout_async(
        self, task: Any, resources: NamedResources, rollout: Rollout
    ) -> AgentResult:
        # Sync agents run on a thread so the runner's event loop keeps serving other rollouts.
        return await run_sync(self.rollout, task, resources, rollout)


class FunctionAgent(LitAgent):
    """A plain function as an agent. Its first parameter gets the task; parameters named
    `resources` or `rollout` get those; a parameter named like a resource, or annotated with
    a resource type of which there is exactly one, gets that resource."""

    def __init__(self, func: Callable[..., AgentResult | Awaitable[AgentResult]]) -> None:
        self.func = func
        self.name = getattr(func, "__qualname__", repr(func))
        self._params = list(inspect.signature(func).parameters.values())
        if not self._params:
            raise TypeError(f"agent {self.name} must take the task as its first parameter")
        self._is_async = inspect.iscoroutinefunction(func)

    def _arguments(self, task: Any, resources: NamedResources, rollout: Rollout) -> list[Any]:
        args: list[Any] = [task]
        for param in self._params[1:]:
            args.append(self._argument(param, resources, rollout))
        return args

    def _argument(
        self, param: inspect.Parameter, resources: NamedResources, rollout: Rollout
    ) -> Any:
        if param.name == "resources":
            return resources
        if param.name == "rollout":
            return rollout
        if param.name in resources:
            return resources[param.name]
        annotation = param.annotation
        wanted = _RESOURCE_TYPES.get(annotation) if isinstance(annotation, str) else annotation
        if isinstance(wanted, type):
            matches = [r for r in resources.values() if isinstance(r, wanted)]
            if len(matches) == 1:
                return matches[0]
        if param.default is not inspect.Parameter.empty:
            return param.default
        raise TypeError(
            f"agent {self.name}: no resource for parameter {param.name!r}; "
            f"resources of this attempt: {sorted(resources)}"
        )

    async def rollout_async(
        self, task: Any, resources: NamedResources, rollout: Rollout
    ) -> AgentResult:
        args = self._arguments(task, resources, rollout)
        if self._is_async:
            pending = self.func(*args)
            assert inspect.isawaitable(pending)
            return await pending
        return await run_sync(self.func, *args)  # type: ignore[arg-type]


def rollout(func: Callable[..., Any]) -> FunctionAgent:
    """Decorate a function (sync or async) as an agent."""
    return FunctionAgent(func)


def as_agent(obj: object) -> LitAgent:
    if isinstance(obj, LitAgent):
        return obj
    if isinstance(obj, type) and issubclass(obj, LitAgent):
        return obj()
    if callable(obj):
        return FunctionAgent(obj)
    raise TypeError(f"{obj!r} is not an agent: use @rollout on a function or subclass LitAgent")


def _raised_where(exc: Exception) -> str:
    """`RuntimeError: boom at agent.py:3`: the error and the line of the module's code."""
    if isinstance(exc, SyntaxError):  # its message names the file and line already
        return f"{type(exc).__name__}: {exc}"
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")
    ]  # <frozen importlib._bootstrap> frames say nothing of the agent's code
    place = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}: {exc}{place}"


def load_agent(spec: str) -> LitAgent:
    """Import "package.module:attribute" and make an agent of it."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"agent {spec!r} must look like package.module:attribute")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as uvicorn and gunicorn do: agents live in projects
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import agent module {module_name!r}: {exc}") from exc
    except Exception as exc:  # the module's own code ran: it may raise anything
        raise ValueError(
            f"cannot import agent module {module_name!r}: {_raised_where(exc)}"
        ) from exc
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from None
    return as_agent(obj)
