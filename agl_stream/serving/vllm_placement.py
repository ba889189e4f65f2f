"""Where vLLM's scheduler runs on a small CPU machine.

vLLM's CPU build binds its worker's threads to some CPUs and leaves the others to its engine
core (the scheduler), which busy-waits on the worker between steps (sched_yield, up to a
second after each step). With fewer than two CPUs outside the worker's, the CPU it spins on
is also the one where vLLM's API server and the policy server answer calls: they wait on the
run queue behind it. Measured on 2 cores (benchmarks.vllm_serving): the policy server's
process, using 3% of a CPU, waited to run 44-77% of the time, and the front kept 0.4-0.6 of
direct vLLM's tokens/s. Moved beside the worker at the lowest priority, the scheduler runs
when the worker waits for it, and the other CPU is left to the calls.

`scheduler_cpus` decides (pure); `place_scheduler` finds vLLM's processes and moves the
scheduler's threads.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable
from pathlib import Path

PLACEMENTS = ("auto", "beside-worker", "vllm")
SCHEDULER_NICE = 19  # the lowest priority: it runs when the worker waits for it
ENGINE_CORE, WORKER = "VLLM::EngineCore", "VLLM::Worker"  # their process titles

log = logging.getLogger(__name__)


def scheduler_cpus(
    placement: str, cpu_build: bool, worker: frozenset[int], scheduler: frozenset[int]
) -> frozenset[int] | None:
    """The CPUs for vLLM's scheduler, or None to leave it where vLLM put it.

    `worker`: the CPUs vLLM bound its worker to; `scheduler`: those the scheduler may use
    now. auto: beside the worker on the CPU build when fewer than two CPUs are left outside
    the worker's (one for the scheduler is all vLLM keeps; the calls need one of their own).
    On a GPU the worker waits on the device, and nothing is moved."""
    if placement not in PLACEMENTS:
        raise ValueError(f"scheduler placement must be one of {', '.join(PLACEMENTS)}")
    if placement == "vllm" or not worker:
        return None
    if placement == "auto" and (not cpu_build or len(scheduler - worker) >= 2):
        return None
    return worker


def place_scheduler(members: Iterable[int], placement: str, cpu_build: bool) -> str:
    """Moves the scheduler among vLLM's processes `members` as `scheduler_cpus` says; what
    was done, in words (logged)."""
    titles = {pid: _title(pid) for pid in members}
    core = [pid for pid, title in titles.items() if title.startswith(ENGINE_CORE)]
    workers = [pid for pid, title in titles.items() if title.startswith(WORKER)]
    if len(core) != 1 or not workers:
        said = f"left where vLLM put it: no single {ENGINE_CORE} and {WORKER} among its processes"
        log.warning("vLLM's scheduler is %s", said)
        return said
    try:
        worker_cpus = frozenset().union(*(os.sched_getaffinity(pid) for pid in workers))
        cpus = scheduler_cpus(
            placement, cpu_build, worker_cpus, frozenset(os.sched_getaffinity(core[0]))
        )
        if cpus is None:
            return "where vLLM put it"
        for thread in _threads(core[0]):  # affinity and priority are each thread's own
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(thread, cpus)
                os.setpriority(os.PRIO_PROCESS, thread, SCHEDULER_NICE)
    except OSError as exc:  # vLLM ended meanwhile: its restart places the next one
        return f"left where vLLM put it: {exc}"
    said = f"beside its worker on CPU {','.join(map(str, sorted(cpus)))} at nice {SCHEDULER_NICE}"
    log.info("vLLM's scheduler (pid %d) runs %s", core[0], said)
    return said


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def _threads(pid: int) -> list[int]:
    return [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()]
