"""The backfill executor: a Ray actor beside one worker, on the worker's device.

It runs one task at a time, a unit at a time, and only inside its stage's idle
windows: it sleeps on the window channel until the trainer opens a window, starts
a unit only when that kind's measured cost, times the governor's margin, fits
what the window has left (`UnitScheduler`), and goes back to sleep when the
window is predicted to close or closes (the stage's data arrived). Training never
waits for it: the trainer only writes to the channel. How busy the executor was
inside and outside windows (fill and overrun) is measured on the trainer's side
(`bubbles.channel`), from the kernel on CPU; the governor answers overruns that
slow the step by widening the margin or pausing backfill.

A task that raises is reported failed to the pool, which retries it; a crash of
this process (out of memory, a segfault) ends only this actor. Neither touches
the worker process or its collectives.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import statistics
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import ray
import torch

from spotline import constants
from spotline.backfill.governor import START_MARGIN
from spotline.backfill.tasks import SETUP, TaskContext, units_of
from spotline.bubbles.channel import BUSY_CLOCK, BUSY_THREAD, WindowChannel
from spotline.checkpoint import CheckpointStore, Manifest
from spotline.config.redact import install_log_redaction
from spotline.config.schema import JobSpec
from spotline.registry import UserCodeError, user_code_error
from spotline.runtime.cpu import idle_priority, pin_process
from spotline.runtime.sealed import SealedJob

log = logging.getLogger("spotline.backfill")

_WAIT_SLICE_S = 0.5  # how often a sleeping executor checks for stop/pause changes
_COST_SAMPLES = 5  # a unit kind's cost is the median of its last measurements
_LENGTHS = 64  # recent window lengths kept (the budget and the "fits no window" test)
_FIRST_UNIT_ROOM = 0.8  # an unmeasured kind starts only with this much of a median window left


class BackfillExecutor:
    def __init__(
        self,
        job: SealedJob,
        rank: int,
        stage: int,
        channel_path: str,
        threads: int = 1,
        pin_core: int | None = None,
    ):
        install_log_redaction()
        self.spec, store = job.open()
        self.rank = rank
        self.stage = stage
        self.channel_path = channel_path
        self.store = store
        self.channel: WindowChannel | None = None
        self.paused = False
        self.free_run = False  # no training left: work without windows
        self.units = UnitScheduler(START_MARGIN)
        self._busy_done_ns = 0  # the busy clock (GPU): device-synced time of finished units
        self._deferred: dict[str, Any] | None = None
        self._slices: collections.deque = collections.deque(maxlen=4096)
        self._totals = {"busy_s": 0.0, "free_s": 0.0, "units": 0}
        self._cache: dict[str, Any] = {}
        torch.set_num_threads(max(1, threads))
        if pin_core is not None:
            pin_process(pin_core)
        # On CPU the executor runs at idle priority (see idle_priority): a unit that is
        # still running when its window closes is simply descheduled, so its wall time
        # says little. There a unit's cost is its thread's CPU time, which the kernel
        # grants only while the stage's threads are idle. On a GPU it is the unit's
        # device-synced wall time.
        self.cpu_mode = not torch.cuda.is_available()
        if self.cpu_mode:
            idle_priority()
        # Ray gives this actor a fraction of the worker's GPU: the same physical device.
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        # Open the dataset now, in the background at idle priority, so the first task's
        # setup does not have to.
        threading.Thread(target=self._warm, daemon=True, name="backfill-warm").start()

    def _warm(self) -> None:
        from spotline.data import job_tokenizer, open_dataset

        with contextlib.suppress(Exception):  # a task opens them itself if this fails
            tok = self._cache.setdefault("tokenizer", job_tokenizer(self.spec))
            self._cache.setdefault("dataset", open_dataset(self.spec, tok))

    # --- control (its own concurrency group: answers while a task runs) ---------------

    @ray.method(concurrency_group="control")
    def configure(self, paused: bool, margin: float, free_run: bool = False) -> None:
        self.paused, self.free_run = paused, free_run
        self.units.margin = margin

    @ray.method(concurrency_group="control")
    def stats(self) -> dict[str, Any]:
        return dict(self._totals) | {
            "rank": self.rank,
            "stage": self.stage,
            "margin": self.units.margin,
        }

    @ray.method(concurrency_group="control")
    def recent_slices(self, since_ns: int = 0) -> list[tuple[int, int, str]]:
        """(start_ns, end_ns, label) of recent units, on this node's CLOCK_MONOTONIC."""
        return [s for s in list(self._slices) if s[1] >= since_ns]

    # --- tasks --------------------------------------------------------------------

    def run(self, task: Any, manifest_json: str) -> dict[str, Any]:
        """Run one task to completion inside windows; its result dict (raises on failure)."""
        manifest = Manifest.from_json(manifest_json)
        busy = [0.0]
        ctx = TaskContext(
            spec=self.spec,
            store=self.store,
            manifest=manifest,
            device=self.device,
            cache=self._cache,
            busy_s=lambda: busy[0],
            unit_budget_s=self.unit_budget_s,
        )
        chan = self._attach()
        if self.cpu_mode:  # the trainer reads this thread's on-CPU time from the kernel
            chan.publish_busy_source(BUSY_THREAD, os.getpid(), threading.get_native_id())
        else:
            chan.publish_busy_source(BUSY_CLOCK)
        self._deferred = None
        t0 = time.monotonic()
        gen = units_of(task, ctx)
        label = None
        setup_s = free_s = 0.0
        while True:
            # The first unit is the task's setup (see tasks.py): it runs at once.
            st = self._wait_for_room(label) if label is not None else None
            start, cpu0 = time.monotonic_ns(), time.thread_time_ns()
            if st is not None and not self.cpu_mode:
                chan.set_busy_clock(self._busy_done_ns - start)
            try:
                # Setup is host work outside the windows: another thread runs it, so the
                # working thread's on-CPU time (what the trainer reads) is units only.
                label = next(gen) if label is not None else _in_thread(lambda: next(gen))
            except StopIteration as done:
                result = dict(done.value or {})
                break
            except Exception as e:
                where = (
                    f"backfill task {getattr(task, 'kind', task)!r} on rank {self.rank} "
                    f"(stage {self.stage}) failed at checkpoint step {manifest.step}"
                )
                theirs = user_code_error(e)  # the pool does not retry these
                if theirs is not None:
                    raise UserCodeError(f"{where}: {theirs}", theirs.module, theirs.field) from e
                tb = traceback.format_exc(limit=6)
                raise RuntimeError(f"{where}: {type(e).__name__}: {e}\n{tb}") from e
            finally:
                if self.device.type == "cuda":
                    torch.cuda.synchronize()  # the unit's device work is done: its time counts
            end, cpu = time.monotonic_ns(), time.thread_time_ns() - cpu0
            work = cpu if self.cpu_mode else end - start
            if not self.cpu_mode and st is not None:
                self._busy_done_ns += work
                chan.set_busy_clock(self._busy_done_ns)
            if label == SETUP:
                setup_s += (end - start) / 1e9
                continue
            busy[0] += work / 1e9
            if st is None:
                free_s += work / 1e9
            self._account(label, start, end, work, st is None)
        result.setdefault("step", manifest.step)
        result["rank"] = self.rank
        result["busy_s"] = busy[0]
        result["setup_s"] = setup_s
        result["after_training_s"] = free_s
        result["wall_s"] = time.monotonic() - t0
        if self._deferred is not None:
            result["deferred"] = self._deferred
        return result

    def _account(self, label: str, start: int, end: int, work: int, free: bool) -> None:
        """Learn the unit's cost (by label) and keep its slice for the trace. Fill and
        overrun are not claimed here: the trainer measures them (see bubbles.channel)."""
        self.units.learn(label, work / 1e9)
        self._slices.append((start, end, label))
        self._totals["units"] += 1
        self._totals["busy_s"] += work / 1e9
        if free:
            self._totals["free_s"] += work / 1e9
        if self.channel is not None:
            self.channel.count_slice()

    def unit_budget_s(self) -> float | None:
        return None if self.free_run else self.units.budget_s()

    def _attach(self) -> WindowChannel:
        while self.channel is None:
            if Path(self.channel_path).exists():
                self.channel = WindowChannel(self.channel_path)
            else:
                time.sleep(0.2)  # the worker creates it when it sets up
        return self.channel

    def _wait_for_room(self, label: str):
        """Block until a window has room for one more unit of `label` (see UnitScheduler);
        None when free-running."""
        chan = self._attach()
        after = -1
        while True:
            if self.free_run:
                return None
            st = chan.wait_open(_WAIT_SLICE_S)
            if st is None:
                continue
            if st.seq <= after:
                time.sleep(0.0005)  # the window we passed on is still open
                continue
            after = st.seq
            if not self.paused and self.units.fits(label, st, time.monotonic_ns()):
                return st
            if self._deferred is None and (why := self.units.deferral(label)) is not None:
                self._deferred = why
                log.info("backfill on rank %d: %s", self.rank, why["why"])


class UnitScheduler:
    """Which unit may start in which window: pure bookkeeping, no clock or I/O of its own.

    A unit starts only when its forecast cost (the median of its kind's last
    measurements), times the governor's margin, fits what the window has left. A
    kind not measured yet starts only with most of a median-length window ahead.
    The first run of a kind is its warm-up, not a measurement: it pays what only
    the first pays (allocations, lazy imports, an optimizer's first construction),
    and a forecast from it could lock the kind out of every window for good. Nothing
    is forced: a unit that costs more than every recent window waits for a window
    it fits, or for the free time after training, and `deferral` says why.
    """

    def __init__(self, margin: float = START_MARGIN):
        self.margin = margin
        self._cost: dict[str, collections.deque] = {}
        self._warmed: set[str] = set()
        self._lengths: collections.deque = collections.deque(maxlen=_LENGTHS)
        self._last_seq = -1

    def learn(self, label: str, seconds: float) -> None:
        if label not in self._warmed:
            self._warmed.add(label)  # the warm-up run: no forecast from it
            return
        self._cost.setdefault(label, collections.deque(maxlen=_COST_SAMPLES)).append(seconds)

    def cost_s(self, label: str) -> float | None:
        """One slow outlier cannot lock a kind out of every window: the median."""
        seen = self._cost.get(label)
        return statistics.median(seen) if seen else None

    def budget_s(self) -> float | None:
        """Seconds a unit may take to fit this stage's typical window; None before any."""
        return statistics.median(self._lengths) / self.margin if self._lengths else None

    def fits(self, label: str, st, now_ns: int) -> bool:
        """May a unit of `label` start now in window `st` (a ChannelState)?"""
        if st.seq != self._last_seq:
            self._last_seq = st.seq
            self._lengths.append((st.predicted_end_ns - st.opened_ns) / 1e9)
        room = (st.predicted_end_ns - now_ns) / 1e9
        cost = self.cost_s(label)
        if cost is None:
            return room >= statistics.median(self._lengths) * _FIRST_UNIT_ROOM
        return room >= cost * self.margin

    def deferral(self, label: str) -> dict[str, Any] | None:
        """Why `label` fits none of the recent windows (None while it may still fit one)."""
        cost = self.cost_s(label)
        if cost is None or len(self._lengths) < _LENGTHS // 4:
            return None
        longest = max(self._lengths)
        if cost <= longest:
            return None
        return {
            "label": label,
            "cost_s": cost,
            "longest_window_s": longest,
            "why": (
                f"a {label!r} unit costs {cost * 1e3:.2f} ms, more than the longest of the "
                f"last {len(self._lengths)} windows ({longest * 1e3:.2f} ms): it waits for "
                "a window it fits, or for the free time after training"
            ),
        }


def _in_thread(fn):
    """fn() run to completion on a short-lived thread; its value, or its exception."""
    out: list = []

    def target():
        try:
            out.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            out.append((False, e))

    t = threading.Thread(target=target, name="backfill-setup", daemon=True)
    t.start()
    t.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


def sidecar_factory(spec: JobSpec, store: CheckpointStore):
    """What the worker group calls per rank to start its executor beside it, in the
    rank's own placement-group bundle (the runtime knows nothing about backfill)."""
    import ray

    from spotline.runtime.actor import channel_path
    from spotline.runtime.placement import worker_name

    # Held by this closure while the executors may restart: their secrets stay in the
    # object store until then.
    sealed = SealedJob(spec, store)
    threads = max(1, int(spec.resources.cpus_per_worker))
    cls = ray.remote(concurrency_groups={"control": 1})(BackfillExecutor)

    def start(topo, where, bundle: dict[str, float], attempt: str):
        return cls.options(
            num_cpus=0,  # shares the worker's CPUs: it only runs while the worker waits
            num_gpus=bundle.get("GPU", 0) * spec.backfill.gpu_fraction,
            name=f"spotline:{spec.name}:backfill:{worker_name(topo)}:{attempt}",
            scheduling_strategy=where,
            max_restarts=-1,  # a crashed task's executor comes back for the next task
        ).remote(
            sealed,
            topo.rank,
            topo.stage,
            channel_path(spec, attempt, topo.rank),
            threads,
            topo.rank if constants.SPOTLINE_PIN_CORES else None,
        )

    return start
