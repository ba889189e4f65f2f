"""What agent authors write against: a decorator or a base class, the rollout they run, and
emitters that record rewards, messages, objects, exceptions and annotations as spans."""

from agl_stream.agent.api import LitAgent, NamedResources, Rollout, load_agent, rollout
from agl_stream.agent.emit import (
    emit_annotation,
    emit_exception,
    emit_message,
    emit_object,
    emit_reward,
)

__all__ = [
    "LitAgent",
    "NamedResources",
    "Rollout",
    "emit_annotation",
    "emit_exception",
    "emit_message",
    "emit_object",
    "emit_reward",
    "load_agent",
    "rollout",
]
