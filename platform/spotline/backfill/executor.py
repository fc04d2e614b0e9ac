"""The backfill executor: a Ray actor beside one worker, on the worker's device.

It runs one task at a time, a unit at a time, and only inside its stage's idle
windows: it sleeps on the window channel until the trainer opens a window, runs
units while the forecast leaves room for one more (its measured cost times a
safety margin), and goes back to sleep when the window is predicted to close or
closes (the stage's data arrived). Training never waits for it: the trainer only
writes to the channel, and a unit that overruns a window costs at most that
unit; the controller's governor widens the margin or pauses backfill when such
overruns slow the step.

A task that raises is reported failed to the pool, which retries it; a crash of
this process (out of memory, a segfault) ends only this actor. Neither touches
the worker process or its collectives.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import ray
import torch

from spotline import constants
from spotline.backfill.tasks import SETUP, TaskContext, units_of
from spotline.bubbles.channel import WindowChannel
from spotline.checkpoint import CheckpointStore, Manifest
from spotline.config.redact import install_log_redaction
from spotline.config.schema import JobSpec
from spotline.runtime.cpu import idle_priority, pin_process

log = logging.getLogger("spotline.backfill")

_WAIT_SLICE_S = 0.5  # how often a sleeping executor checks for stop/pause changes
_MAX_PASSED = 5  # windows a unit may pass on for want of room before it runs anyway


class BackfillExecutor:
    def __init__(
        self,
        spec_json: str,
        rank: int,
        stage: int,
        channel_path: str,
        store: CheckpointStore,
        threads: int = 1,
        pin_core: int | None = None,
    ):
        install_log_redaction()
        self.spec = JobSpec.model_validate_json(spec_json)
        self.rank = rank
        self.stage = stage
        self.channel_path = channel_path
        self.store = store
        self.channel: WindowChannel | None = None
        self.margin = 1.5
        self.paused = False
        self.free_run = False  # no training left: work without windows
        self._cost: dict[str, float] = {}  # EMA seconds of one unit, by label
        self._slices: collections.deque = collections.deque(maxlen=4096)
        self._totals = {"filled_s": 0.0, "overrun_s": 0.0, "free_s": 0.0, "units": 0}
        self._cache: dict[str, Any] = {}
        torch.set_num_threads(max(1, threads))
        if pin_core is not None:
            pin_process(pin_core)
        # On CPU the executor runs at idle priority (see idle_priority): a unit that is
        # still running when its window closes is simply descheduled, so its wall time
        # says little. There its cost and its fill are its CPU time, which the kernel
        # grants only while the stage's threads are idle. On a GPU a unit's wall time
        # inside the window is the measure.
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
        self.paused, self.margin, self.free_run = paused, margin, free_run

    @ray.method(concurrency_group="control")
    def stats(self) -> dict[str, Any]:
        return dict(self._totals) | {"rank": self.rank, "stage": self.stage, "margin": self.margin}

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
        )
        t0 = time.monotonic()
        gen = units_of(task, ctx)
        label = None
        setup_s = 0.0
        while True:
            # The first unit is the task's setup (see tasks.py): it runs at once.
            st = self._wait_for_room(label) if label is not None else None
            start, cpu0 = time.monotonic_ns(), time.process_time_ns()
            try:
                label = next(gen)
            except StopIteration as done:
                result = dict(done.value or {})
                break
            except Exception as e:
                tb = traceback.format_exc(limit=6)
                raise RuntimeError(
                    f"backfill task {getattr(task, 'kind', task)!r} on rank {self.rank} "
                    f"(stage {self.stage}) failed at checkpoint step {manifest.step}: "
                    f"{type(e).__name__}: {e}\n{tb}"
                ) from e
            end, cpu = time.monotonic_ns(), time.process_time_ns() - cpu0
            if label == SETUP:
                setup_s += (end - start) / 1e9
                continue
            if self.device.type == "cuda":
                torch.cuda.synchronize()  # the unit's device work is done: its wall time counts
                end = time.monotonic_ns()
            work = cpu if self.cpu_mode else end - start
            busy[0] += work / 1e9
            self._account(st, start, end, work, label)
        result.setdefault("step", manifest.step)
        result["rank"] = self.rank
        result["busy_s"] = busy[0]
        result["setup_s"] = setup_s
        result["wall_s"] = time.monotonic() - t0
        return result

    def _account(self, st, start: int, end: int, work: int, label: str) -> None:
        seconds = work / 1e9
        old = self._cost.get(label)
        self._cost[label] = seconds if old is None else 0.7 * old + 0.3 * seconds
        self._slices.append((start, end, label))
        self._totals["units"] += 1
        if st is None:  # free run, or a forced unit: no window involved
            self._totals["free_s"] += seconds
            return
        if self.cpu_mode:
            filled, over = work, 0  # the governor measures what it cost training
        # The unit counts as filling the window it started in, up to that window's
        # close; anything after (even inside later windows) counts as overrun.
        elif (now := self.channel.state()).seq == st.seq and now.open:
            filled, over = end - start, 0
        else:
            closed = self.channel.closed_at(st.seq)
            closed = closed if closed is not None else start  # unknown: assume no fill
            filled = max(0, min(end, closed) - start)
            over = end - start - filled
        self._totals["filled_s"] += filled / 1e9
        self._totals["overrun_s"] += over / 1e9
        self.channel.account(filled, over)

    def _attach(self) -> WindowChannel:
        while self.channel is None:
            if Path(self.channel_path).exists():
                self.channel = WindowChannel(self.channel_path)
            else:
                time.sleep(0.2)  # the worker creates it when it sets up
        return self.channel

    def _wait_for_room(self, label: str | None):
        """Block until a window has room for one more unit of `label`; None when free-running.

        A unit whose measured cost has not fit any of the last `_MAX_PASSED` windows
        runs at the start of the next one anyway, so a task whose units are all bigger
        than this stage's windows advances instead of starving; the overrun it causes
        is measured, and the governor answers it.
        """
        chan = self._attach()
        after = -1
        passed = 0
        while True:
            if self.free_run:
                return None
            st = chan.wait_open(_WAIT_SLICE_S)
            if st is None:
                continue
            if st.seq <= after:
                time.sleep(0.0005)  # the window we passed on is still open
                continue
            if self.paused:
                after = st.seq
                continue
            need = self._cost.get(label, 0.0) * self.margin if label else 0.0
            room = (st.predicted_end_ns - time.monotonic_ns()) / 1e9
            if room >= need or passed >= _MAX_PASSED:
                return st
            after = st.seq  # not enough room left in this window: wait for the next
            passed += 1


def sidecar_factory(spec: JobSpec, store: CheckpointStore):
    """What the worker group calls per rank to start its executor beside it, in the
    rank's own placement-group bundle (the runtime knows nothing about backfill)."""
    import ray

    from spotline.runtime.actor import channel_path
    from spotline.runtime.group import worker_name

    spec_json = spec.model_dump_json()
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
            spec_json,
            topo.rank,
            topo.stage,
            channel_path(spec, attempt, topo.rank),
            store,
            threads,
            topo.rank if constants.SPOTLINE_PIN_CORES else None,
        )

    return start
