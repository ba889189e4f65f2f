"""Where vLLM's scheduler runs (agl_stream/serving/vllm_placement.py): the decision, and the
move made on real processes titled as vLLM titles its engine core and worker (so no vLLM is
needed here; test_vllm checks it on vLLM's own)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agl_stream.serving.vllm_placement import (
    ENGINE_CORE,
    SCHEDULER_NICE,
    WORKER,
    place_scheduler,
    scheduler_cpus,
)

TWO = frozenset({0, 1})


def test_auto_moves_the_scheduler_beside_the_worker_only_on_a_small_cpu_machine() -> None:
    # vLLM's own binding on 2 cores: the worker on one, the scheduler free on both.
    assert scheduler_cpus("auto", True, frozenset({0}), TWO) == frozenset({0})
    # Two CPUs or more outside the worker's: one for the scheduler, one for the calls.
    assert scheduler_cpus("auto", True, frozenset({0, 1}), frozenset(range(4))) is None
    assert scheduler_cpus("auto", True, frozenset({0}), frozenset({0, 1, 2})) is None
    # A GPU build: the worker waits on the device.
    assert scheduler_cpus("auto", False, frozenset({0}), TWO) is None


def test_the_other_placements_say_it_outright() -> None:
    assert scheduler_cpus(
        "beside-worker", False, frozenset({2, 3}), frozenset(range(8))
    ) == frozenset({2, 3})
    assert scheduler_cpus("vllm", True, frozenset({0}), TWO) is None
    assert scheduler_cpus("beside-worker", True, frozenset(), TWO) is None  # no worker seen
    with pytest.raises(ValueError, match="scheduler placement must be one of auto"):
        scheduler_cpus("anywhere", True, frozenset({0}), TWO)


def titled(title: str, cpus: set[int] | None = None) -> subprocess.Popen[bytes]:
    """A process whose command line starts with `title`, as vLLM's setproctitle makes it."""
    process = subprocess.Popen(["bash", "-c", f"exec -a {title} sleep 600"])
    if cpus is not None:
        os.sched_setaffinity(process.pid, cpus)
    return process


@pytest.fixture
def vllm_like() -> Iterator[tuple[int, int]]:
    cpus = sorted(os.sched_getaffinity(0))
    worker = titled(WORKER, {cpus[0]})
    core = titled(ENGINE_CORE)
    try:
        for process, title in ((core, ENGINE_CORE), (worker, WORKER)):
            while not Path(f"/proc/{process.pid}/cmdline").read_text().startswith(title):
                time.sleep(0.01)  # until bash has exec'd sleep under the title
        yield core.pid, worker.pid
    finally:
        for process in (core, worker):
            process.kill()
            process.wait()


def test_the_scheduler_moves_beside_the_worker_at_the_lowest_priority(
    vllm_like: tuple[int, int],
) -> None:
    core, worker = vllm_like
    said = place_scheduler([os.getpid(), core, worker], "beside-worker", cpu_build=True)
    assert os.sched_getaffinity(core) == os.sched_getaffinity(worker)
    assert os.getpriority(os.PRIO_PROCESS, core) == SCHEDULER_NICE
    assert said == (
        f"beside its worker on CPU {min(os.sched_getaffinity(worker))} at nice {SCHEDULER_NICE}"
    )
    assert os.getpriority(os.PRIO_PROCESS, os.getpid()) != SCHEDULER_NICE  # the others stay


def test_left_alone_when_told_or_when_vllm_is_not_recognised(vllm_like: tuple[int, int]) -> None:
    core, worker = vllm_like
    before = os.sched_getaffinity(core)
    assert place_scheduler([core, worker], "vllm", cpu_build=True) == "where vLLM put it"
    assert place_scheduler([worker], "beside-worker", cpu_build=True).startswith(
        f"left where vLLM put it: no single {ENGINE_CORE}"
    )
    assert os.sched_getaffinity(core) == before
    assert os.getpriority(os.PRIO_PROCESS, core) == 0
