"""Times every instruction a pipeline stage runs, and opens backfill windows.

`StepRecorder.attach(engine)` replaces the engine's instruction table with timed
wrappers (DeepSpeed looks the table up on the instance, so only this engine is
affected) and wraps the loss broadcast that ends `train_batch`. The trainer
calls `begin_step` before `train_batch` and `record_sync` around its per-step
agreement; everything in between is one step's timeline. Only `train_batch` is
recorded: `eval_batch` runs the same instructions outside a step and is ignored.

Clocks. On CPU each instruction is bracketed by two host `time.monotonic`
reads and its step's timeline is ready when the step ends. On a CUDA device it
is bracketed by two timing events recorded on the stream the engine computes
on, so the timeline is the device's: a forward lasts as long as its kernels,
and a receive (NCCL makes the compute stream wait for its own) lasts until the
data arrived on the device. Nothing here synchronizes: a step's events are read
one step later, with `Event.query()`, and a step whose events are not complete
yet stays pending until a later step (at most `max_pending` steps; beyond that
the oldest is dropped and counted in the totals as `dropped`). Each step also
keeps its start on the node's CLOCK_MONOTONIC, which places it in the trace.

The resolved timeline is the one truth: it feeds the forecast, the totals and
the recent steps the trace is drawn from. Until a step has been measured the
forecast is `simulate`'s over the real schedule at the stages' estimated costs
(`micro_s`), so the first steps already open windows.

The live signal to the backfill executor stays on the host: the channel opens
when the host enters a wait instruction and closes when the host leaves it. On
a GPU the host runs ahead of the device, so it may enter a wait (say, a
receive) while the device is still finishing the compute queued before it: the
window opens early by that queue's length. The predicted window length it
announces is the device's, from the forecast.

Per instruction this costs two clock reads and a list append (plus, on a GPU,
recording the two events); a wait that the forecast says is long enough also
writes a few integers and a byte to the executor's channel.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import MethodType
from typing import Any

from spotline.bubbles.channel import WindowChannel
from spotline.bubbles.detector import Forecast, windows
from spotline.bubbles.schedule import COMPUTE, PASSES, WAITS, Instr, program, simulate_passes


class HostClock:
    """Host monotonic seconds; a mark is complete when it is taken."""

    lag = 0
    """Steps a timeline waits before it is read: none, it is final at once."""
    mark = staticmethod(time.monotonic)

    def step_start(self, host_now: float) -> float:
        return host_now

    def done(self, mark: Any) -> bool:
        return True

    def seconds(self, start: Any, mark: Any) -> float:
        return mark - start

    def release(self, start: Any, instrs: list[tuple[str, Any, Any]]) -> None:
        pass


class DeviceClock:
    """CUDA timing events recorded on the engine's compute stream.

    `event` makes a timing event (torch.cuda.Event(enable_timing=True)); `stream`
    returns the stream to record on (torch.cuda.current_stream(device)), looked up
    at every step start. Events of read steps are reused.
    """

    lag = 1
    """A step is read one step after it ended, when its events should be done."""

    def __init__(
        self,
        device: Any = None,
        event: Callable[[], Any] | None = None,
        stream: Callable[[], Any] | None = None,
    ):
        import torch

        self._event = event or partial(torch.cuda.Event, enable_timing=True)
        self._stream_of = stream or partial(torch.cuda.current_stream, device)
        self._stream: Any = None
        self._free: list[Any] = []

    def step_start(self, host_now: float) -> Any:
        self._stream = self._stream_of()
        return self.mark()

    def mark(self) -> Any:
        ev = self._free.pop() if self._free else self._event()
        ev.record(self._stream)
        return ev

    def done(self, mark: Any) -> bool:
        # One stream completes its events in order: the last one done means all are.
        return mark.query()

    def seconds(self, start: Any, mark: Any) -> float:
        return start.elapsed_time(mark) / 1e3

    def release(self, start: Any, instrs: list[tuple[str, Any, Any]]) -> None:
        """The events of a step that has been read, free to be recorded again."""
        self._free.append(start)
        for _, s, e in instrs:
            self._free += (s, e)


def clock_for(device: Any) -> HostClock | DeviceClock:
    """Device events for an engine on CUDA, host clocks otherwise."""
    if getattr(device, "type", None) == "cuda":
        return DeviceClock(device)
    return HostClock()


@dataclass
class _Step:
    """A step recorded and not yet read: its marks are the clock's."""

    step: int
    host_start: float
    """The step's start on this node's CLOCK_MONOTONIC."""
    start: Any
    instrs: list[tuple[str, Any, Any]]
    micro_batches: int
    program: list[tuple[int, str]]


class StepRecorder:
    """One pipeline stage's step timelines, forecast and totals.

    `micro_s`: the seconds every stage spends on the forward and backward of one
    micro-batch (`plan.stage_micro_s`), from which the forecast starts before any step
    is measured (None: it starts empty). `clock`: HostClock or DeviceClock; by default
    `attach` picks the engine's (`clock_for(engine.device)`), host clocks until then.
    """

    def __init__(
        self,
        stage: int,
        stages: int,
        micro_batches: int,
        channel: WindowChannel | None = None,
        min_window_s: float = 0.0,
        history: int = 4,
        micro_s: list[float] | None = None,
        clock: HostClock | DeviceClock | None = None,
        max_pending: int = 8,
        on_instruction: Callable[[str], None] | None = None,
    ):
        self.stage = stage
        self.stages = stages
        self.micro_batches = micro_batches
        self.channel = channel
        self.min_window_s = min_window_s
        self.micro_s = micro_s
        self._clock_given = clock is not None
        self._use(clock or HostClock())
        self.max_pending = max_pending
        self.on_instruction = on_instruction
        """Told each instruction's name as it begins (the rank's heartbeat)."""
        self.recent: deque[tuple[int, float, list[Instr]]] = deque(maxlen=history)
        """(step, start on CLOCK_MONOTONIC, timeline) of the last steps read."""
        self._totals = {
            "steps": 0,
            "step_s": 0.0,
            "wait_s": 0.0,
            "compute_s": 0.0,
            "passes_s": 0.0,
            "window_s": 0.0,
            "windows": 0,
            "dropped": 0,
        }
        self._step: int | None = None
        self._host_t0 = 0.0
        self._t0: Any = 0.0
        self._instrs: list[tuple[str, Any, Any]] = []
        self._pending: deque[_Step] = deque()
        self._program: list[tuple[int, str]] | None = None
        self.forecast = self._cold_forecast()
        # The training thread closes steps; the worker's control thread reads the totals.
        self._lock = threading.Lock()

    # --- wiring -----------------------------------------------------------------

    def attach(self, engine: Any) -> None:
        if not self._clock_given:
            self._use(clock_for(getattr(engine, "device", None)))
        from spotline.compat.deepspeed import wrap_loss_reduction, wrap_pipeline_instructions

        wrap_pipeline_instructions(engine, lambda cls, fn: self._timed(cls.__name__, fn))
        wrap_loss_reduction(engine, lambda aggregate: lambda: self._run("LossSync", aggregate))

    def _use(self, clock: HostClock | DeviceClock) -> None:
        self.clock = clock
        self._mark = clock.mark  # bound once: the per-instruction path reads one attribute

    def _timed(self, name: str, fn):
        recorder = self

        def run(engine_self, **kwargs):
            return recorder._run(name, MethodType(fn, engine_self), **kwargs)

        return run

    def _run(self, name: str, fn, *args, **kwargs):
        if self._step is None:  # outside train_batch (eval_batch): not a training step
            return fn(*args, **kwargs)
        if self.on_instruction is not None:
            self.on_instruction(name)
        instrs = self._instrs
        predicted = self.forecast.remaining(len(instrs)) if name in WAITS else 0.0
        signal = self.channel is not None and predicted > self.min_window_s
        if signal:
            self.channel.open_window(predicted)
        mark = self._mark
        start = mark()
        try:
            return fn(*args, **kwargs)
        finally:
            end = mark()
            if signal:
                self.channel.close_window()
            instrs.append((name, start, end))

    def set_micro_batches(self, micro_batches: int) -> None:
        """The schedule depth changed (an adaptive batch): forget the old program and
        the forecast learnt from it, and start again from the simulated schedule."""
        if micro_batches != self.micro_batches:
            self.micro_batches = micro_batches
            self._program = None
            self.forecast = self._cold_forecast()

    # --- the cold start -----------------------------------------------------------

    def seed_timeline(self) -> list[Instr] | None:
        """What this stage should record in one step at the estimated stage costs
        (None without them): the schedule simulated, instruction for instruction."""
        if self.micro_s is None:
            return None
        return simulate_passes(self.stages, self.micro_batches, list(self.micro_s))[self.stage]

    def _cold_forecast(self) -> Forecast:
        forecast = Forecast()
        seed = self.seed_timeline()
        if seed is not None:
            forecast.seed(seed)
        return forecast

    # --- steps ------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        if self._step is not None:
            self.end_step()
        self._step = step
        self._instrs = []
        self._host_t0 = time.monotonic()
        self._t0 = self.clock.step_start(self._host_t0)
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
        """Close the step being recorded, and read the steps whose times are known."""
        if self._step is None:
            return
        if self.channel is not None:
            self.channel.step_end()
        if self._program is None:
            self._program = program(self.stages, self.micro_batches, self.stage)
        self._pending.append(
            _Step(
                self._step,
                self._host_t0,
                self._t0,
                self._instrs,
                self.micro_batches,
                self._program,
            )
        )
        self._step = None
        self._instrs = []
        self.resolve()
        dropped = 0
        while len(self._pending) > self.max_pending:
            self._pending.popleft()  # its events may still be in flight: not reused
            dropped += 1
        if dropped:
            with self._lock:
                self._totals["dropped"] += dropped

    def resolve(self) -> int:
        """Read, oldest first, the closed steps whose marks are complete (never
        waiting for one), at least the clock's lag behind the newest; how many."""
        clock = self.clock
        n = 0
        while len(self._pending) > clock.lag:
            st = self._pending[0]
            last = st.instrs[-1][2] if st.instrs else st.start
            if not clock.done(last):
                break
            self._pending.popleft()
            self._close(st)
            n += 1
        return n

    def pending_steps(self) -> list[int]:
        """Steps closed and not yet read (their device times are not known yet)."""
        return [st.step for st in self._pending]

    def _close(self, st: _Step) -> None:
        clock = self.clock
        seconds = clock.seconds
        prog = st.program
        timeline = [
            Instr(
                name,
                prog[k][0] if k < len(prog) and prog[k][1] == name else -1,
                seconds(st.start, start),
                seconds(st.start, end),
            )
            for k, (name, start, end) in enumerate(st.instrs)
        ]
        clock.release(st.start, st.instrs)
        if st.micro_batches == self.micro_batches:  # not a step of a schedule since left
            self.forecast.update(timeline)
        usable = windows(timeline, self.min_window_s)
        with self._lock:
            t = self._totals
            t["steps"] += 1
            t["step_s"] += timeline[-1].end if timeline else 0.0
            t["wait_s"] += sum(i.seconds for i in timeline if i.name in WAITS)
            # What the stage's own layers cost: the stage partition balances this.
            t["compute_s"] += sum(i.seconds for i in timeline if i.name in COMPUTE)
            # Its forward and backward passes alone: no collective, no transfer, no
            # data (the straggler watch compares ranks by it).
            t["passes_s"] += sum(i.seconds for i in timeline if i.name in PASSES)
            t["windows"] += len(usable)
            t["window_s"] += sum(w.seconds for w in usable)
            self.recent.append((st.step, st.host_start, timeline))

    def recent_steps(self) -> list[tuple[int, float, list[Instr]]]:
        """A copy of the last steps' (step, start, timeline), safe from any thread."""
        with self._lock:
            return list(self.recent)

    def take_totals(self) -> dict[str, float]:
        """Sums over the steps read since the last call: steps, step_s, wait_s,
        compute_s, passes_s, windows, window_s, and steps dropped unread (dropped)."""
        with self._lock:
            out, self._totals = self._totals, dict.fromkeys(self._totals, 0)
        out["bubble_fraction"] = out["wait_s"] / out["step_s"] if out["step_s"] else 0.0
        return out


TRACE_REPLICAS = 4
"""Replicas of each stage whose ranks send their latest steps' timelines (the trace
draws them): the replicas of a stage run the same schedule, and a timeline from each of
thousands of ranks at every poll would cost the controller megabytes per poll for a
trace nobody can read."""


def sends_timeline(replica: int) -> bool:
    """Whether a rank of this replica sends its steps' timelines with its report."""
    return replica < TRACE_REPLICAS


METERED = ("filled", "overrun", "open", "beyond")
"""The window channel's fill meters, reported per chunk as `<name>_s` (bubbles.channel)."""


def bubble_report(
    rec: StepRecorder | None, channel: Any, topo: Any, seen: tuple[int, ...]
) -> tuple[dict[str, Any] | None, tuple[int, ...]]:
    """A stage's bubble figures since the last report (`rec`'s totals, and the window
    channel's fill meters past `seen`), and its latest steps' timeline: what a rank
    publishes (its timeline only on the first TRACE_REPLICAS replicas); with the meters'
    readings to start from next time."""
    if rec is None:
        return None, seen
    out: dict[str, Any] = rec.take_totals()
    if not out["steps"]:
        return None, seen
    out.update(stage=topo.stage, replica=topo.replica, rank=topo.rank)
    if channel is not None:
        st = channel.state()
        now = tuple(getattr(st, f"{key}_ns") for key in METERED)
        for key, after, before in zip(METERED, now, seen, strict=True):
            out[f"{key}_s"] = (after - before) / 1e9
        seen = now
    if sends_timeline(topo.replica):
        out["steps_timeline"] = [
            {
                "step": step,
                "start_ns": int(t0 * 1e9),
                "instrs": [(i.name, i.slot, i.start, i.end) for i in timeline],
            }
            for step, t0, timeline in rec.recent_steps()
        ]
    return out, seen
