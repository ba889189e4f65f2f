"""A user's training script, as Agent Lightning users write them: the agent at the top level,
Trainer.fit under the main guard (the runners import this file to find the agent). The fit
tests run it and press Ctrl-C."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from agl_stream import GRPO, Trainer
from agl_stream.demo.task import echo_letter
from agl_stream.events import LLM


async def agent(task: dict[str, Any], llm: LLM) -> float:
    return await echo_letter(task, llm)


if __name__ == "__main__":
    algorithm = GRPO(steps=500, group_size=4, groups_per_step=2)
    trainer = Trainer(algorithm=algorithm, n_runners=1, out_dir=Path(sys.argv[1]))
    trainer.fit(agent, train_dataset=[{"letter": letter} for letter in "abcde"])
