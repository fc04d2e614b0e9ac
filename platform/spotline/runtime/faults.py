"""Faults a test or benchmark injects into its own job's ranks. Never set in production.

Two switches, both needed: SPOTLINE_TEST_FAULTS names a directory (it reaches the
workers through Ray's job runtime_env), and the job's spec says `failure.test_faults:
true`. A variable left set on a production cluster therefore does nothing to a job
that is not marked as a test: its faults are not applied, and the controller says so
once (`refusal`). The faults of job NAME are the JSON list in `<dir>/NAME.json`, read
once when a rank sets up:

  {"kind": "freeze", "rank": 1, "step": 6, "phase": "forward"}
      rank 1 stops its own process with SIGSTOP in the first forward of step 6
      ("save": while it writes its checkpoint of that step): alive, silent, and its
      peers blocked in their next collective, as a wedged device or a hung host leaves
      them. It fires once per job (a marker file beside the list), not again after the
      restart.
  {"kind": "slow", "rank": 1, "factor": 2.0}   (or "node": "<node id>")
      that rank's compute (or that of every rank on that node) takes `factor` times as
      long: its forward passes at pp = 1, its forward and backward instructions in a
      pipeline. A straggler, for as long as the job runs.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from spotline.bubbles.schedule import PASSES
from spotline.config.schema import JobSpec

ENV = "SPOTLINE_TEST_FAULTS"


def _slowed(fn, factor: float):
    """`fn`, then (factor - 1) x its usual duration (the median of its last 20) of busy
    waiting: the rank keeps its core as a slower device would (a sleeping process comes
    back to cold caches), and one call that the host stretched is not stretched twice."""
    if factor <= 1.0:
        return fn
    recent: deque[float] = deque(maxlen=20)

    def slow(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        t1 = time.perf_counter()
        recent.append(t1 - t0)
        until = t1 + (factor - 1.0) * statistics.median(recent)
        while time.perf_counter() < until:
            pass
        return out

    return slow


def _listed(spec: JobSpec) -> Path | None:
    """The fault list SPOTLINE_TEST_FAULTS holds for this job, if any."""
    root = os.environ.get(ENV)
    if not root:
        return None
    path = Path(root) / f"{spec.name}.json"
    return path if path.is_file() else None


def refusal(spec: JobSpec) -> str | None:
    """What to say, once per job, when SPOTLINE_TEST_FAULTS holds faults for a job whose
    spec is not marked as a test: they are not applied. None otherwise."""
    path = _listed(spec)
    if path is None or spec.failure.test_faults:
        return None
    return (
        f"{ENV} names faults for this job ({path}), but its spec does not set "
        "failure.test_faults: true, so none is applied; unset the variable outside tests"
    )


class Faults:
    def __init__(self, faults: list[dict[str, Any]], marker_root: Path | None = None):
        self.faults = faults
        self.marker_root = marker_root

    @classmethod
    def for_rank(cls, spec: JobSpec, rank: int, node_id: str) -> Faults | None:
        """This rank's faults (None: none injected, the production case, or the spec
        is not marked as a test)."""
        path = _listed(spec)
        if path is None or not spec.failure.test_faults:
            return None
        mine = [
            dict(f, index=i)
            for i, f in enumerate(json.loads(path.read_text()))
            if f.get("rank") == rank or (f.get("node") and f.get("node") == node_id)
        ]
        return cls(mine, path.with_suffix("")) if mine else None

    def slow_factor(self) -> float:
        return max([f.get("factor", 1.0) for f in self.faults if f["kind"] == "slow"] or [1.0])

    def wrap_engine(self, engine: Any, step_of) -> None:
        """Make this rank's passes slow ("slow": its forward at pp = 1, its forward and
        backward instructions in a pipeline, what each measures as its compute) and its
        forward freezable ("freeze" at "forward"). `step_of()`: the step being trained.
        Runs before anything times the engine."""
        factor = self.slow_factor()
        freezes = any(f["kind"] == "freeze" and f.get("phase") != "save" for f in self.faults)
        if factor > 1.0:
            from spotline.compat.deepspeed import wrap_pipeline_instructions

            def slowed(cls: type, fn: Any) -> Any:
                return _slowed(fn, factor) if cls.__name__ in PASSES else fn

            if wrap_pipeline_instructions(engine, slowed):  # a pipeline stage
                factor = 1.0
        if factor == 1.0 and not freezes:
            return
        module = engine.module
        forward = module.forward

        def faulty(*args, **kwargs):
            self.maybe_freeze(step_of(), "forward")
            return _slowed(forward, factor)(*args, **kwargs)

        module.forward = faulty

    def maybe_freeze(self, step: int, phase: str) -> None:
        for f in self.faults:
            due = f["kind"] == "freeze" and f.get("step") == step
            if due and f.get("phase", "forward") == phase and self._first_time(f):
                # Sent to this thread, which then stops the process before it runs
                # another line: sent to the process, the stop waits for whichever thread
                # takes it, and on a busy host this one trains on past the freeze.
                signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)

    def _first_time(self, fault: dict[str, Any]) -> bool:
        assert self.marker_root is not None
        marker = Path(f"{self.marker_root}.{fault['index']}.fired")
        try:
            marker.touch(exist_ok=False)
        except FileExistsError:
            return False
        return True
