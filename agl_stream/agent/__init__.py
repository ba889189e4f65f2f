"""What agent authors write against: a decorator or a base class, the rollout they run,
emitters that record rewards, messages, objects, exceptions and annotations as spans, and
in_attempt for work that a thread the agent did not start runs for it, and ProcessAgent for
agents in any language (one process per attempt)."""

from agl_stream.agent.api import LitAgent, NamedResources, Rollout, load_agent, rollout
from agl_stream.agent.emit import (
    emit_annotation,
    emit_exception,
    emit_message,
    emit_object,
    emit_reward,
)
from agl_stream.agent.process import ProcessAgent
from agl_stream.agent.tracing import in_attempt

__all__ = [
    "LitAgent",
    "NamedResources",
    "ProcessAgent",
    "Rollout",
    "emit_annotation",
    "emit_exception",
    "emit_message",
    "emit_object",
    "emit_reward",
    "in_attempt",
    "load_agent",
    "rollout",
]
