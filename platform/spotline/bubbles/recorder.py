"""Times every instruction a pipeline stage runs, and opens backfill windows.

`StepRecorder.attach(engine)` replaces the engine's instruction table with timed
wrappers (DeepSpeed looks the table up on the instance, so only this engine is
affected) and wraps the loss broadcast that ends `train_batch`. The trainer
calls `begin_step` before `train_batch` and `sync` around its per-step
agreement; everything in between is one step's timeline.

Per instruction this costs two clock reads and a list append; a wait that the
forecast says is long enough also writes a few integers and a byte to the
executor's channel. Only `train_batch` is recorded: `eval_batch` runs the same
instructions outside a step and is ignored.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from types import MethodType
from typing import Any

from spotline.bubbles.channel import WindowChannel
from spotline.bubbles.detector import Forecast, windows
from spotline.bubbles.schedule import COMPUTE, WAITS, Instr, program


class StepRecorder:
    def __init__(
        self,
        stage: int,
        stages: int,
        micro_batches: int,
        channel: WindowChannel | None = None,
        min_window_s: float = 0.0,
        history: int = 4,
    ):
        self.stage = stage
        self.stages = stages
        self.micro_batches = micro_batches
        self.channel = channel
        self.min_window_s = min_window_s
        self.forecast = Forecast()
        self.recent: deque[tuple[int, float, list[Instr]]] = deque(maxlen=history)
        """(step, start on CLOCK_MONOTONIC, timeline) of the last steps."""
        self._totals = {
            "steps": 0,
            "step_s": 0.0,
            "wait_s": 0.0,
            "compute_s": 0.0,
            "window_s": 0.0,
            "windows": 0,
        }
        self._step: int | None = None
        self._t0 = 0.0
        self._instrs: list[Instr] = []
        self._program: list[tuple[int, str]] | None = None
        # The training thread closes steps; the worker's control thread reads the totals.
        self._lock = threading.Lock()

    # --- wiring -----------------------------------------------------------------

    def attach(self, engine: Any) -> None:
        table = dict(type(engine)._INSTRUCTION_MAP)
        engine._INSTRUCTION_MAP = {cls: self._timed(cls.__name__, fn) for cls, fn in table.items()}
        aggregate = engine._aggregate_total_loss
        engine._aggregate_total_loss = lambda: self._run("LossSync", aggregate)

    def _timed(self, name: str, fn):
        recorder = self

        def run(engine_self, **kwargs):
            return recorder._run(name, MethodType(fn, engine_self), **kwargs)

        return run

    def _run(self, name: str, fn, *args, **kwargs):
        if self._step is None:  # outside train_batch (eval_batch): not a training step
            return fn(*args, **kwargs)
        predicted = self.forecast.remaining(len(self._instrs)) if name in WAITS else 0.0
        signal = self.channel is not None and predicted > self.min_window_s
        if signal:
            self.channel.open_window(predicted)
        start = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            end = time.monotonic()
            if signal:
                self.channel.close_window()
            self._instrs.append(Instr(name, -1, start - self._t0, end - self._t0))

    def set_micro_batches(self, micro_batches: int) -> None:
        """The schedule depth changed (an adaptive batch): forget the old program and
        the forecast learnt from it."""
        if micro_batches != self.micro_batches:
            self.micro_batches = micro_batches
            self._program = None
            self.forecast = Forecast()

    # --- steps ------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        if self._step is not None:
            self.end_step()
        self._step = step
        self._instrs = []
        self._t0 = time.monotonic()
        if self.channel is not None:
            self.channel.step_begin()

    def record_sync(self, fn):
        """Run the all-rank agreement `fn` as the step's last wait, then close the step."""
        if self._step is None:
            return fn()
        try:
            return self._run("StepSync", fn)
        finally:
            self.end_step()

    def end_step(self) -> None:
        if self._step is None:
            return
        if self.channel is not None:
            self.channel.step_end()
        timeline = self._with_slots(self._instrs)
        self.forecast.update(timeline)
        usable = windows(timeline, self.min_window_s)
        with self._lock:
            t = self._totals
            t["steps"] += 1
            t["step_s"] += timeline[-1].end if timeline else 0.0
            t["wait_s"] += sum(i.seconds for i in timeline if i.name in WAITS)
            # What the stage's own layers cost: the stage partition balances this.
            t["compute_s"] += sum(i.seconds for i in timeline if i.name in COMPUTE)
            t["windows"] += len(usable)
            t["window_s"] += sum(w.seconds for w in usable)
            self.recent.append((self._step, self._t0, timeline))
        self._step = None

    def _with_slots(self, instrs: list[Instr]) -> list[Instr]:
        if self._program is None:
            self._program = program(self.stages, self.micro_batches, self.stage)
        prog = self._program
        return [
            Instr(
                i.name, prog[k][0] if k < len(prog) and prog[k][1] == i.name else -1, i.start, i.end
            )
            for k, i in enumerate(instrs)
        ]

    def recent_steps(self) -> list[tuple[int, float, list[Instr]]]:
        """A copy of the last steps' (step, start, timeline), safe from any thread."""
        with self._lock:
            return list(self.recent)

    def take_totals(self) -> dict[str, float]:
        """Sums since the last call: steps, step_s, wait_s, compute_s, windows, window_s."""
        with self._lock:
            out, self._totals = self._totals, dict.fromkeys(self._totals, 0)
        out["bubble_fraction"] = out["wait_s"] / out["step_s"] if out["step_s"] else 0.0
        return out
