"""CPU placement of a process: pin it to a core, or run it at idle priority.

On CPU a core stands in for a device: benchmarks pin a worker and its backfill
executor to the same core, and the executor yields that core to the worker.
"""

from __future__ import annotations

import contextlib
import os


def idle_priority() -> None:
    """Run every thread of this process at SCHED_IDLE: on a CPU "device" the kernel
    then gives the core to the stage's threads (compute, and gloo's transport
    threads) the moment they are runnable, so a backfill unit can delay training by
    at most a scheduler wake-up. It is the CPU counterpart of a low-priority stream."""
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None:
        return
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))


def pin_process(core: int) -> None:
    """Pin every thread of this process to one core (benchmarks: a core is the device)."""
    cores = sorted(os.sched_getaffinity(0))
    target = {cores[core % len(cores)]}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), target)
