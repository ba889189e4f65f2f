"""Agent Lightning 0.3's Trainer and its APO, unchanged, with agl-stream as their store:

    python examples/agl_agent/train.py --llm-endpoint http://127.0.0.1:8000/v1 --model tiny \\
        --optimizer-endpoint https://api.openai.com/v1 --optimizer-model gpt-4.1-mini

APO (Agent Lightning's, the default; `--algorithm baseline` runs its Baseline instead) measures
the seed template on the validation tasks, asks the optimizer LLM for a critique of the
training rollouts and for a template rewritten by it, measures each rewrite, keeps the best and
publishes it as the resources version `apo-best`. Everything the trainer, its runners and the
algorithm record goes to agl-stream's topics and read model (AGL_STREAM_BOOTSTRAP_SERVERS,
AGL_STREAM_DATABASE_URL; `agl-stream up` starts them), so it is still there after the script
ends: `agl-stream store` serves it to Agent Lightning's LightningStoreClient.
"""

# ruff: noqa: I001  (agl_stream.compat.agl first: it imports Agent Lightning without its network calls)
from __future__ import annotations

import argparse
import asyncio
import os
import random
from typing import TYPE_CHECKING, Any

from agl_stream.compat.agl import AglStreamStore
import agentlightning as agl
from agentlightning.adapter import TraceToMessages
from openai import AsyncOpenAI

from agent import SEED_TEMPLATE, follow_rules, tasks

if TYPE_CHECKING:
    from agentlightning.algorithm.apo import APO

BEST = "apo-best"  # the resources id the best template is published under


def apo(args: argparse.Namespace) -> APO[dict[str, Any]]:
    """Agent Lightning's APO, small enough for a demo: one round, one template kept."""
    from agentlightning.algorithm.apo import APO  # imports poml (the extra `agl` installs it)

    optimizer = AsyncOpenAI(
        base_url=args.optimizer_endpoint or args.llm_endpoint,
        api_key=os.environ.get("OPENAI_API_KEY", "unused"),
    )
    return APO(
        optimizer,
        gradient_model=args.optimizer_model,
        apply_edit_model=args.optimizer_model,
        gradient_batch_size=args.gradient_batch,
        val_batch_size=args.tasks - args.tasks // 2,  # every validation task, every time
        beam_width=args.beam_width,
        branch_factor=args.branch_factor,
        beam_rounds=args.rounds,
        rollout_batch_timeout=args.batch_timeout,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--llm-endpoint", required=True, help="the agent's OpenAI-compatible URL")
    parser.add_argument("--model", default="tiny", help="the agent's model")
    parser.add_argument("--algorithm", choices=["apo", "baseline"], default="apo")
    parser.add_argument("--optimizer-endpoint", help="APO's LLM (default: --llm-endpoint)")
    parser.add_argument("--optimizer-model", default="gpt-4.1-mini", help="APO's model")
    parser.add_argument("--rounds", type=int, default=1, help="APO's beam rounds")
    parser.add_argument("--beam-width", type=int, default=1, help="templates APO keeps")
    parser.add_argument("--branch-factor", type=int, default=2, help="rewrites of each")
    parser.add_argument("--gradient-batch", type=int, default=4, help="rollouts a critique reads")
    parser.add_argument("--batch-timeout", type=float, default=600.0, help="seconds per batch")
    parser.add_argument("--seed", type=int, default=0, help="APO's sampling (Python's random)")
    parser.add_argument("--tasks", type=int, default=8, help="half train, half validation")
    parser.add_argument("--runners", type=int, default=2, help="runner processes")
    parser.add_argument("--template", default=SEED_TEMPLATE, help="the seed prompt template")
    args = parser.parse_args()

    # The agent's LLM, for it and its runners (agent.py reads the environment).
    os.environ["OPENAI_BASE_URL"] = args.llm_endpoint
    os.environ.setdefault("OPENAI_API_KEY", "unused")
    os.environ["AGENT_MODEL"] = args.model
    random.seed(args.seed)

    store = AglStreamStore()
    optimizer = apo(args) if args.algorithm == "apo" else None
    algorithm: agl.Algorithm
    if optimizer is not None:
        # APO critiques the rollouts' chat messages, which this adapter reads from their spans:
        # the runner processes send them to the store by OTLP (importing agl_stream.compat.agl lets
        # Agent Lightning's exporter do so with OpenTelemetry's HTTP exporter 1.45).
        algorithm, adapter = optimizer, TraceToMessages()
    else:
        algorithm, adapter = agl.Baseline(n_epochs=1, polling_interval=0.2), None
    trainer = agl.Trainer(
        algorithm=algorithm,
        strategy={"type": "cs", "n_runners": args.runners},  # runner processes, store over HTTP
        store=store,
        initial_resources={
            "prompt_template": agl.PromptTemplate(template=args.template, engine="f-string")
        },
        adapter=adapter,
    )
    all_tasks = tasks(args.tasks)
    half = len(all_tasks) // 2
    try:
        trainer.fit(follow_rules, train_dataset=all_tasks[:half], val_dataset=all_tasks[half:])
        if optimizer is not None:
            best = optimizer.get_best_prompt()
            asyncio.run(store.update_resources(BEST, {"prompt_template": best}))
            print(f"APO's best prompt template, published as resources {BEST!r}:")
            print(best.template)
    finally:
        store.close()


if __name__ == "__main__":
    main()
