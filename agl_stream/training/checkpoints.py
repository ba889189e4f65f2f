"""A directory of checkpoints, one per step, each with the trainer's state and lineage.

step-000012/ holds the weights (safetensors), the tokenizer, the optimiser state and
trainer.json: the step, the resources version it was published as, the offset range of every
partition the step consumed, the attempts it trained on, and what a resumed trainer must
remember. A checkpoint is written under a temporary name and renamed when whole, so a trainer
killed while writing leaves no half checkpoint that looks complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

STATE_FILE = "trainer.json"
OPTIMIZER_FILE = "optimizer.pt"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


def checkpoint_root(location: str) -> Path:
    """A local path or a file:// URI (other schemes need a filesystem this release lacks)."""
    parsed = urlparse(location)
    if parsed.scheme == "file":  # Path.as_uri() percent-encodes (a space is %20)
        return Path(url2pathname(parsed.path)).expanduser().resolve()
    if parsed.scheme == "":
        return Path(location).expanduser().resolve()
    raise ValueError(
        f"checkpoint location {location!r}: only local paths and file:// URIs are supported"
    )


class CheckpointStore:
    def __init__(self, location: str) -> None:
        self.root = checkpoint_root(location)

    def step_dir(self, step: int) -> Path:
        return self.root / f"step-{step:06d}"

    def step_of(self, uri: str) -> int | None:
        """The step whose directory `uri` names, if it is one of this store's."""
        try:
            path = checkpoint_root(uri)
        except ValueError:
            return None
        if path.parent != self.root or not path.name.startswith("step-"):
            return None
        number = path.name.removeprefix("step-")
        return int(number) if number.isdigit() else None

    def steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and (entry / STATE_FILE).is_file():
                found.append(int(match.group(1)))
        return sorted(found)

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.step_dir(steps[-1]) if steps else None

    def clean_partial(self) -> None:
        """Remove what a killed trainer left half written."""
        if self.root.is_dir():
            for entry in self.root.glob("*.partial-*"):
                shutil.rmtree(entry, ignore_errors=True)

    def write(self, step: int, fill: Any, state: Mapping[str, Any]) -> Path:
        """Write step `step`: `fill(directory)` saves the weights and optimiser into it, then
        trainer.json is written and the directory renamed into place, durably."""
        final = self.step_dir(step)
        if final.exists():
            raise FileExistsError(f"checkpoint {final} exists already")
        self.root.mkdir(parents=True, exist_ok=True)
        partial = self.root / f"{final.name}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        fill(partial)
        (partial / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True))
        for file in partial.iterdir():
            _fsync(file)
        os.rename(partial, final)
        _fsync(self.root)
        return final

    def state(self, step: int) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads((self.step_dir(step) / STATE_FILE).read_text())
        return loaded

    def lineage(self) -> list[dict[str, Any]]:
        """trainer.json of every step, in order."""
        return [self.state(step) for step in self.steps()]


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def lineage_problems(states: list[dict[str, Any]]) -> list[str]:
    """What breaks "every consumed offset range exactly once": each step's range of a
    partition must start at the previous step's cut and end at its own; no attempt may be
    trained on twice."""
    problems: list[str] = []
    used: dict[tuple[str, str], int] = {}
    previous: dict[str, Any] | None = None
    for state in states:
        step = state["step"]
        for tp, (start, end) in state.get("consumed", {}).items():
            if end < start:
                problems.append(f"step {step}: {tp} range [{start}, {end}) runs backwards")
            if previous is not None and previous["cut"].get(tp) != start:
                problems.append(
                    f"step {step}: {tp} starts at {start}, "
                    f"step {previous['step']} ended at {previous['cut'].get(tp)}"
                )
            if state["cut"].get(tp) != end:
                problems.append(
                    f"step {step}: {tp} ends at {end}, its cut is {state['cut'].get(tp)}"
                )
        if previous is not None and set(state["cut"]) != set(state.get("consumed", {})):
            problems.append(f"step {step}: the consumed ranges do not cover every partition")
        for rollout_id, attempt_id in state.get("used", []):
            if (rollout_id, attempt_id) in used:
                first = used[(rollout_id, attempt_id)]
                problems.append(
                    f"step {step}: attempt {attempt_id} was already used by step {first}"
                )
            used[(rollout_id, attempt_id)] = step
        previous = state
    return problems
