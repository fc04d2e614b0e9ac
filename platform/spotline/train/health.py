"""A rank's health signals: its heartbeat (the step and phase it is in) and its own
compute time per step, for the controller's hang and straggler watch.

The training thread writes both; the worker's control thread reads them when the
controller polls, so publishing never waits on training. A heartbeat is one tuple
assignment per phase change (atomic in CPython: no lock). The compute meter times
what no collective and no pipeline transfer enters: at pp > 1 the stage's forward and
backward instructions (the pipeline's `StepRecorder` times them), at pp = 1 the
forward passes (the backward of a ZeRO rank includes its gradient reduction). On a
GPU it brackets them with CUDA events read a step later, as the recorder does.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from spotline.bubbles.recorder import clock_for

DATA_PHASE = "data (waiting for the step's batches)"
"""The phase of a rank waiting for its step's batches: held up by storage or the data
source, not hung (the controller calls it a data stall)."""

# What a pipeline instruction is, in the words `spotline status` shows.
_INSTRUCTIONS = {
    "ForwardPass": "forward",
    "BackwardPass": "backward",
    "LoadMicroBatch": "load micro-batch",
    "OptimizerStep": "optimizer step",
    "ReduceGrads": "gradient all-reduce (collective)",
    "ReduceTiedGrads": "tied-gradient all-reduce (collective)",
    "SendActivation": "send activation (p2p)",
    "RecvActivation": "receive activation (p2p)",
    "SendGrad": "send gradient (p2p)",
    "RecvGrad": "receive gradient (p2p)",
    "LossSync": "loss broadcast (collective)",
    "StepSync": "step agreement (collective)",
}


class Heartbeat:
    """The step a rank works on and what it is doing in it, with when that began."""

    def __init__(self, clock=time.time):
        self._clock = clock
        self._beat: tuple[int, str, float] = (0, "starting", clock())
        self._micro = 0  # forward passes begun in this step (a pipeline's micro-batch)

    def phase(self, name: str, step: int | None = None) -> None:
        """Now in phase `name` (of step `step`; None: the same step)."""
        self._beat = (self._beat[0] if step is None else step, name, self._clock())

    def begin_step(self, step: int) -> None:
        self._micro = 0
        self.phase(DATA_PHASE, step)

    def instruction(self, name: str) -> None:
        """A pipeline instruction begins (`StepRecorder`'s hook)."""
        words = _INSTRUCTIONS.get(name, name)
        if name == "ForwardPass":
            self._micro += 1
            words = f"forward micro-batch {self._micro}"
        self.phase(words)

    def read(self) -> dict[str, Any]:
        """{"step", "phase", "phase_s"}: safe from any thread."""
        step, phase, since = self._beat
        return {"step": step, "phase": phase, "phase_s": max(0.0, self._clock() - since)}


class ComputeMeter:
    """Seconds of a rank's own compute per step (pp = 1: its forward passes).

    `start()`/`stop(mark)` bracket one forward; `end_step()` closes the step; `take()`
    returns the steps read since the last call and their summed compute seconds. On a
    GPU a step is read once its events completed (one step later), never waiting."""

    def __init__(self, device: Any = None, max_pending: int = 8, clock: Any = None):
        self.clock = clock or clock_for(device)
        self._open: list[tuple[str, Any, Any]] = []
        self._step_start: Any = None
        self._pending: deque[tuple[Any, list[tuple[str, Any, Any]]]] = deque()
        self.max_pending = max_pending
        self._steps = 0
        self._seconds = 0.0
        self._lock = threading.Lock()  # the training thread adds, the control thread takes

    def begin_step(self) -> None:
        self._open = []
        self._step_start = self.clock.step_start(time.monotonic())

    def start(self) -> Any:
        if self._step_start is None:
            self.begin_step()
        return self.clock.mark()

    def stop(self, start: Any) -> None:
        self._open.append(("forward", start, self.clock.mark()))

    def end_step(self) -> None:
        if self._step_start is None:
            return
        self._pending.append((self._step_start, self._open))
        self._step_start, self._open = None, []
        clock = self.clock
        while len(self._pending) > clock.lag:
            start, marks = self._pending[0]
            if marks and not clock.done(marks[-1][2]):
                break
            self._pending.popleft()
            seconds = sum(clock.seconds(s, e) for _, s, e in marks)
            clock.release(start, marks)
            with self._lock:
                self._steps += 1
                self._seconds += seconds
        while len(self._pending) > self.max_pending:
            self._pending.popleft()  # its events may still be in flight: not reused

    def take(self) -> tuple[int, float]:
        """(steps, compute seconds) read since the last call."""
        with self._lock:
            out = (self._steps, self._seconds)
            self._steps, self._seconds = 0, 0.0
        return out
