"""The layout a newcomer reads: every package of agl_stream is on the architecture map, the
package list that installs them names them all, the root holds few modules, and the import
paths earlier releases documented still work, saying where they moved."""

from __future__ import annotations

import importlib
import re
import sys
import tomllib

import pytest

from tests.support import ROOT

PACKAGE = ROOT / "agl_stream"
# The root's modules: the package itself and the documented paths of earlier releases.
ROOT_MODULES = {"__init__.py", "config.py", "enqueue.py", "late_rewards.py"}
MOVED = {
    "agl_stream.config": ("agl_stream.runtime.config", "KafkaSettings"),
    "agl_stream.enqueue": ("agl_stream.commands.enqueue", "enqueue"),
    "agl_stream.late_rewards": ("agl_stream.commands.rewards", "RewardSender"),
    "agl_stream.agl": ("agl_stream.compat.agl", "AglStreamStore"),
}


def _packages() -> set[str]:
    return {".".join(init.parent.relative_to(ROOT).parts) for init in PACKAGE.rglob("__init__.py")}


def test_every_package_is_on_the_architecture_map() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    mapped = set(re.findall(r"^\| `([a-z_/]+)/` \|", page, re.M))
    packages = {"/".join(p.split(".")[1:3]) for p in _packages() if p.count(".") in (1, 2)}
    tops = {p for p in packages if "/" not in p} - {"agl"}  # agl/: an old path only
    covered = {m.split("/")[0] for m in mapped}
    assert tops - covered == set(), f"missing from docs/architecture.md: {tops - covered}"
    assert mapped - packages == set(), f"the map names what is not there: {mapped - packages}"


def test_the_install_lists_every_package() -> None:
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    data = {"agl_stream.schemas", "agl_stream.topics", "agl_stream.workers"}
    assert listed - data == _packages()


def test_the_root_holds_the_package_and_the_old_paths_only() -> None:
    assert {p.name for p in PACKAGE.glob("*.py")} == ROOT_MODULES


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_import_path_works_and_says_where_it_moved(old: str) -> None:
    new, name = MOVED[old]
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)
