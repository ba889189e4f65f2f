"""What the policy modules share of Hugging Face's libraries: a model with its tokenizer, and
quiet calls into transformers and peft (no hub, no progress bars, no warnings of theirs)."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


def quiet_transformers() -> None:
    """No hub access (nothing outside the machine is reachable) and no progress bars of
    transformers' own in the middle of ours."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


@dataclass
class Policy:
    """A causal LM and its tokenizer."""

    model: Any  # transformers.PreTrainedModel
    tokenizer: Any  # transformers.PreTrainedTokenizerBase

    @property
    def name(self) -> str:
        return str(getattr(self.model.config, "_name_or_path", "") or "policy")


@contextlib.contextmanager
def peft_calls() -> Iterator[None]:
    """peft 0.21 calls transformers 5.x APIs that warn of their renaming in v6
    (`is_gradient_checkpointing`, ...): not ours to fix, and not to fail on."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".* is deprecated and will be removed in v6", category=FutureWarning
        )
        yield
