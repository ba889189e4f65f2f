"""A directory of checkpoints, one per step, each with the trainer's state and lineage.

step-000012/ holds the weights (safetensors), the tokenizer, the optimiser state and
trainer.json: the step, the resources version it was published as, the offset range of every
partition the step consumed, the attempts it trained on, and what a resumed trainer must
remember. A checkpoint is written under a temporary name and renamed when whole, so a trainer
killed while writing leaves no half checkpoint that looks complete; one pruned is renamed out
of the step names before its files are removed, so a trainer killed while pruning leaves no
half-deleted checkpoint that looks whole either. A LoRA run's base model, when the trainer
made it (`--init-model tiny`), lives in base/ beside the steps and is never pruned.
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

from agl_stream.training import object_store

STATE_FILE = "trainer.json"
OPTIMIZER_FILE = "optimizer.pt"
BASE_DIR = "base"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
_LEFTOVERS = ("*.partial-*", "*.pruned-*")


def checkpoint_root(location: str) -> Path:
    """A local path or a file:// URI; for s3:// (object_store.py), this machine's cache."""
    parsed = urlparse(location)
    if parsed.scheme == "file":  # Path.as_uri() percent-encodes (a space is %20)
        return Path(url2pathname(parsed.path)).expanduser().resolve()
    if parsed.scheme == "":
        return Path(location).expanduser().resolve()
    if object_store.is_remote(location):
        return object_store.cache_dir(location)
    raise ValueError(
        f"checkpoint location {location!r}: local paths, file:// and s3:// URIs are supported"
    )


def local_directory(uri: str) -> Path:
    """A checkpoint's directory on this machine (an object store's is downloaded once)."""
    return object_store.local_copy(uri) if object_store.is_remote(uri) else checkpoint_root(uri)


class CheckpointStore:
    """Steps in a local directory or, with `remote`, in an object store (each written in a
    local cache first, then uploaded, its trainer.json last)."""

    def __init__(self, location: str) -> None:
        self.root = checkpoint_root(location)
        self.remote = object_store.storage(location) if object_store.is_remote(location) else None

    def step_dir(self, step: int) -> Path:
        """The step's local directory (with an object store: where it is cached)."""
        return self.root / f"step-{step:06d}"

    def uri(self, step: int) -> str:
        """What a published checkpoint of the step points at."""
        name = self.step_dir(step).name
        return self.remote.uri(name) if self.remote else self.step_dir(step).as_uri()

    def step_of(self, uri: str) -> int | None:
        """The step whose directory `uri` names, if it is one of this store's."""
        if self.remote is not None:
            name = self.remote.name_of(uri)
        else:
            try:
                path = checkpoint_root(uri)
            except ValueError:
                return None
            name = path.name if path.parent == self.root else None
        match = _STEP_DIR.match(name or "")
        return int(match.group(1)) if match else None

    def steps(self) -> list[int]:
        if self.remote is not None:
            names = self.remote.names(STATE_FILE)
            return sorted(int(m.group(1)) for n in names if (m := _STEP_DIR.match(n)))
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and (entry / STATE_FILE).is_file():
                found.append(int(match.group(1)))
        return sorted(found)

    def latest(self) -> Path | None:
        """The latest step's local directory (downloaded first when it is only remote)."""
        steps = self.steps()
        if not steps:
            return None
        if self.remote is not None:
            return local_directory(self.uri(steps[-1]))
        return self.step_dir(steps[-1])

    def clean_partial(self) -> None:
        """Remove what a killed trainer left half written or half pruned."""
        if self.root.is_dir():
            for pattern in _LEFTOVERS:
                for entry in self.root.glob(pattern):
                    shutil.rmtree(entry, ignore_errors=True)

    def prune(self, steps: list[int]) -> None:
        """Delete these steps. Each directory is first renamed out of the step names, durably,
        so that no reader (a resuming trainer, a policy server, a runner) finds a checkpoint
        half deleted: it finds the whole directory or none. A crash after the rename leaves
        `step-N.pruned-PID`, which clean_partial removes. In an object store the step's
        marker (trainer.json) goes first, so it stops counting before its files go."""
        for step in steps:
            directory = self.step_dir(step)
            if self.remote is not None:
                self.remote.delete(directory.name, first=STATE_FILE)
                if not directory.exists():  # not cached here
                    continue
            doomed = self.root / f"{directory.name}.pruned-{os.getpid()}"
            os.rename(directory, doomed)
            _fsync(self.root)
            shutil.rmtree(doomed)

    @property
    def base_dir(self) -> Path:
        return self.root / BASE_DIR

    def write_base(self, fill: Any) -> Path:
        """The base model of a LoRA run, written like a step (whole or not at all); one left
        by an earlier start of a run that wrote no step yet is replaced."""
        self.root.mkdir(parents=True, exist_ok=True)
        partial = self.root / f"{BASE_DIR}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        fill(partial)
        for file in partial.iterdir():
            _fsync(file)
        shutil.rmtree(self.base_dir, ignore_errors=True)
        os.rename(partial, self.base_dir)
        _fsync(self.root)
        return self.base_dir

    def write(self, step: int, fill: Any, state: Mapping[str, Any]) -> Path:
        """Write step `step`: `fill(directory)` saves the weights and optimiser into it, then
        trainer.json is written and the directory renamed into place, durably."""
        final = self.step_dir(step)
        if self.remote is not None and step in self.steps():
            raise FileExistsError(f"checkpoint {self.uri(step)} exists already")
        if self.remote is not None:
            shutil.rmtree(final, ignore_errors=True)  # a cached copy never uploaded
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
        if self.remote is not None:  # stored once its trainer.json is, which goes last
            self.remote.upload(partial, final.name, last=STATE_FILE)
        os.rename(partial, final)
        _fsync(self.root)
        return final

    def state(self, step: int) -> dict[str, Any]:
        if self.remote is not None:
            return object_store.read_json(self.remote, self.step_dir(step).name, STATE_FILE)
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
    trained on twice. Steps that --keep pruned leave gaps: a step after a gap is checked
    against its own cut only (and attempts only among the steps kept)."""
    problems: list[str] = []
    used: dict[tuple[str, str], int] = {}
    previous: dict[str, Any] | None = None
    for state in states:
        step = state["step"]
        if previous is not None and previous["step"] != step - 1:
            previous = None  # the steps between were pruned
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
