"""An Agent Lightning 0.3 runner in a process of its own, as its users start one beside a store
server: its Trainer in client-server mode in the runner role, which finds the server by
AGL_SERVER_HOST and AGL_SERVER_PORT and talks to it through LightningStoreClient, with its
default tracer (AgentOps). It runs examples/agl_agent's agent (one LLM call per rollout, the
LLM from OPENAI_BASE_URL and AGENT_MODEL) on `argv[1]` rollouts, then exits."""

# ruff: noqa: I001  (agl_stream.compat.agl first: it imports Agent Lightning without its network calls)
from __future__ import annotations

import sys
from pathlib import Path

import agl_stream.compat.agl  # noqa: F401
import agentlightning as agl

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "agl_agent"))
from agent import follow_rules

if __name__ == "__main__":
    strategy = {"type": "cs", "role": "runner", "n_runners": 1}
    agl.Trainer(strategy=strategy, max_rollouts=int(sys.argv[1])).fit(follow_rules)
