"""Agent Lightning 0.3's Trainer, unchanged, with agl-stream as its store:

    python examples/agl_agent/train.py --llm-endpoint http://127.0.0.1:8000/v1 --model tiny

Everything the trainer, its runners and the algorithm (Agent Lightning's Baseline) record
goes to agl-stream's topics and read model (AGL_STREAM_BOOTSTRAP_SERVERS,
AGL_STREAM_DATABASE_URL; `agl-stream up` starts them), so it is still there after the
script ends: `agl-stream store` serves it to Agent Lightning's LightningStoreClient.
"""

# isort: skip_file  (agl_stream.agl first: it imports Agent Lightning without its network calls)
from __future__ import annotations

import argparse

from agl_stream.agl import AglStreamStore
import agentlightning as agl

from agent import SEED_TEMPLATE, follow_rules, tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--llm-endpoint", required=True, help="OpenAI-compatible base URL")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--runners", type=int, default=2)
    parser.add_argument("--template", default=SEED_TEMPLATE, help="the prompt template to use")
    args = parser.parse_args()

    store = AglStreamStore()
    trainer = agl.Trainer(
        algorithm=agl.Baseline(n_epochs=1, polling_interval=0.2),
        n_runners=args.runners,
        store=store,
        initial_resources={
            "prompt_template": agl.PromptTemplate(template=args.template, engine="f-string"),
            "llm": agl.LLM(endpoint=args.llm_endpoint, model=args.model),
        },
    )
    all_tasks = tasks(args.tasks)
    half = len(all_tasks) // 2
    trainer.fit(follow_rules, train_dataset=all_tasks[:half], val_dataset=all_tasks[half:])
    store.close()


if __name__ == "__main__":
    main()
