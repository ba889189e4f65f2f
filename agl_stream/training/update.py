"""The trainer's update step, pluggable: what the trainer hands a batch to and checkpoints.

The trainer owns everything around the update (reading the topics, assembling trajectories,
grouping, advantages, staleness weights, checkpoints with their lineage, publishing); an
update only turns one step's samples into new weights of the model it was built on, and
saves and restores its own state (optimiser moments, random state) with each checkpoint.
`GRPO` (grpo.py) is the one built in. TrainerConfig.update takes a factory of another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from agl_stream.training.batching import TrainSample

if TYPE_CHECKING:
    from agl_stream.training.grpo import UpdateStats


class PolicyUpdate(Protocol):
    def update(self, samples: Sequence[TrainSample]) -> UpdateStats:
        """Train on one step's samples (each: prompt and response token ids, the response's
        recorded logprobs, its advantage and staleness weight); runs in a worker thread."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What resuming needs, saved with every checkpoint (torch.save)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# (the policy's model, as the trainer placed it, and the tokenizer's pad id) -> an update
UpdateFactory = Callable[[Any, int], PolicyUpdate]
