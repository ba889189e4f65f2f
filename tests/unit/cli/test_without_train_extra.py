"""The CLI without the `train` extra (the slim image, EXTRAS=s3): every role's command loads.
`agl-stream --help` once imported the demo's agent, hence torch, and the slim image's build
failed in install.sh's check."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Runs in a child interpreter where the train extra's packages cannot be imported.
WITHOUT_TRAIN = """
import importlib.abc, sys
TRAIN = {"torch", "openai", "transformers", "peft", "safetensors", "matplotlib"}
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in TRAIN:
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Missing())
from agl_stream.cli.main import cli
cli(sys.argv[1:])
"""


@pytest.mark.parametrize(
    "command",
    [[], ["worker", "runner"], ["worker", "trainer"], ["serve"], ["demo"]],
)
def test_every_command_loads_without_torch(command: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRAIN, *command, "--help"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
