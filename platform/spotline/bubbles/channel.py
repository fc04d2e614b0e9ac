"""The trainer -> backfill executor signal: a shared page and a FIFO, and the fill meter.

A stage and its executor run in two processes on one node and share a device.
The trainer must pay almost nothing per window, so it writes a few integers into
an mmap'ed file and one byte into a FIFO (no Ray call, no lock, no syscall it
could block in). The executor sleeps in `select` on the FIFO and, once woken,
reads the page: is the window still open, and until when is it predicted to
last.

**Fill and overrun are measured by the trainer, not claimed by the executor.**
The executor publishes where its busy time can be read (`publish_busy_source`):

- on CPU, its working thread: the trainer reads that thread's on-CPU time from
  the kernel (`/proc/<pid>/task/<tid>/schedstat`, nanoseconds);
- on a GPU, a busy clock in the page: the executor's finished units' device-synced
  wall time plus the running unit's elapsed time, in one 8-byte word.

`FillMeter` reads that busy counter when a window opens and closes, and at the
start and end of each step. Fill is the busy time inside open windows. Overrun is
the busy time during the step outside them: time the executor held the device
while the stage was computing (or waiting too briefly for a window). A single
working thread cannot be busy longer than a window is open, so a fill above the
window time is a bug, and no figure is capped.

Both sides use CLOCK_MONOTONIC, which is one clock for every process of a node.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_FIELDS = (
    "seq",  # windows opened so far
    "open",  # 1 while the stage waits
    "predicted_end_ns",  # when the open window should close
    "closed_ns",  # when the last window closed
    "filled_ns",  # trainer: executor busy time inside windows
    "overrun_ns",  # trainer: executor busy time in steps, outside windows
    "slices",  # executor: units of work run
    "opened_ns",  # when the open (or last) window opened
    "open_ns",  # trainer: total time windows were open
    "busy_mode",  # executor: 0 none, 1 a CPU thread (schedstat), 2 the busy clock
    "busy_pid",  # executor: its process (busy_mode 1)
    "busy_tid",  # executor: its working thread (busy_mode 1)
    "busy_clock",  # executor (busy_mode 2): done_ns when idle, done_ns - unit start if busy
    "beyond_ns",  # trainer: time windows stayed open past their predicted end
)
_FMT = "<" + "q" * len(_FIELDS)
_SIZE = struct.calcsize(_FMT)
_OFF = {name: 8 * i for i, name in enumerate(_FIELDS)}

BUSY_NONE, BUSY_THREAD, BUSY_CLOCK = 0, 1, 2


@dataclass(frozen=True)
class ChannelState:
    seq: int
    open: int
    predicted_end_ns: int
    closed_ns: int
    filled_ns: int
    overrun_ns: int
    slices: int
    opened_ns: int
    open_ns: int
    busy_mode: int
    busy_pid: int
    busy_tid: int
    busy_clock: int
    beyond_ns: int


def busy_clock_value(word: int, now_ns: int) -> int:
    """Busy nanoseconds from the busy-clock word: idle, the word; mid-unit, word + now."""
    return word if word >= 0 else word + now_ns


class FillMeter:
    """Fill and overrun from a cumulative busy counter read at window and step edges.

    Pure arithmetic over (time, busy) samples, so scripted windows test it exactly:
    fill = busy inside open windows; overrun = busy during steps outside windows.
    """

    def __init__(self):
        self.filled_ns = 0
        self.overrun_ns = 0
        self.open_ns = 0
        self.beyond_ns = 0  # open past the predicted end: no unit may start there
        self._win: tuple[int, int | None, int] | None = None  # (opened at, busy, predicted end)
        self._step: int | None = None  # busy at step start
        self._step_in = 0  # busy inside windows during this step

    def window_open(self, now_ns: int, busy_ns: int | None, predicted_end_ns: int = 0) -> None:
        self._win = (now_ns, busy_ns, predicted_end_ns or now_ns)

    def window_close(self, now_ns: int, busy_ns: int | None) -> None:
        if self._win is None:
            return
        opened, b0, predicted_end = self._win
        self._win = None
        self.open_ns += now_ns - opened
        self.beyond_ns += max(0, now_ns - max(opened, predicted_end))
        if busy_ns is not None and b0 is not None:
            inside = busy_ns - b0
            self.filled_ns += inside
            self._step_in += inside

    def step_begin(self, busy_ns: int | None) -> None:
        self._step, self._step_in = busy_ns, 0

    def step_end(self, busy_ns: int | None) -> None:
        if self._step is not None and busy_ns is not None:
            # Negative only if a window's reads raced the executor's restart: never charge it.
            self.overrun_ns += max(0, busy_ns - self._step - self._step_in)
        self._step, self._step_in = None, 0


class WindowChannel:
    """One side of a rank's channel. `create=True` on the trainer, False on the executor."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        create: bool = False,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ):
        self.path = Path(path)
        self._now = clock_ns
        fifo = self.path.with_suffix(".fifo")
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_bytes(b"\0" * _SIZE)
            with contextlib.suppress(FileNotFoundError):
                fifo.unlink()
            os.mkfifo(fifo)
        self._file = open(self.path, "r+b")  # noqa: SIM115 - lives as long as the channel
        self._mm = mmap.mmap(self._file.fileno(), _SIZE)
        # O_RDWR: opening never blocks and never fails for want of the other end.
        self._fifo = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
        self.meter = FillMeter()
        self._stat_fd: int | None = None
        self._stat_of: tuple[int, int] = (0, 0)

    def _get(self, name: str) -> int:
        return struct.unpack_from("<q", self._mm, _OFF[name])[0]

    def _set(self, name: str, value: int) -> None:
        struct.pack_into("<q", self._mm, _OFF[name], value)

    def _add(self, name: str, value: int) -> None:
        self._set(name, self._get(name) + value)

    def state(self) -> ChannelState:
        return ChannelState(*struct.unpack_from(_FMT, self._mm, 0))

    # --- trainer side -----------------------------------------------------------

    def busy_ns(self) -> int | None:
        """The executor's cumulative busy nanoseconds now; None before it published a source."""
        mode = self._get("busy_mode")
        if mode == BUSY_CLOCK:
            return busy_clock_value(self._get("busy_clock"), self._now())
        if mode != BUSY_THREAD:
            return None
        who = (self._get("busy_pid"), self._get("busy_tid"))
        if who != self._stat_of:
            self._close_stat()
            with contextlib.suppress(OSError):
                self._stat_fd = os.open(f"/proc/{who[0]}/task/{who[1]}/schedstat", os.O_RDONLY)
            self._stat_of = who
        if self._stat_fd is None:
            return None
        try:
            return int(os.pread(self._stat_fd, 64, 0).split(None, 1)[0])
        except (OSError, ValueError, IndexError):  # the executor exited: no busy time to read
            self._close_stat()
            return None

    def _close_stat(self) -> None:
        if self._stat_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._stat_fd)
        self._stat_fd = None

    def open_window(self, predicted_s: float) -> None:
        now = self._now()
        end = now + int(predicted_s * 1e9)
        self.meter.window_open(now, self.busy_ns(), end)
        self._set("opened_ns", now)
        self._set("predicted_end_ns", end)
        self._set("open", 1)
        self._set("seq", self._get("seq") + 1)
        with contextlib.suppress(BlockingIOError):  # a full FIFO: the executor is behind
            os.write(self._fifo, b"w")

    def close_window(self) -> None:
        now = self._now()
        self._set("closed_ns", now)
        self._set("open", 0)
        self.meter.window_close(now, self.busy_ns())

    def step_begin(self) -> None:
        self.meter.step_begin(self.busy_ns())

    def step_end(self) -> None:
        """Close the step's meter and publish the totals (read between steps, so once
        per step is enough: a window close writes nothing more than it must)."""
        m = self.meter
        m.step_end(self.busy_ns())
        self._set("filled_ns", m.filled_ns)
        self._set("overrun_ns", m.overrun_ns)
        self._set("open_ns", m.open_ns)
        self._set("beyond_ns", m.beyond_ns)

    # --- executor side ----------------------------------------------------------

    def publish_busy_source(self, mode: int, pid: int = 0, tid: int = 0) -> None:
        """Where the trainer reads this executor's busy time (see the module docstring)."""
        self._set("busy_pid", pid)
        self._set("busy_tid", tid)
        self._set("busy_mode", mode)

    def set_busy_clock(self, word: int) -> None:
        self._set("busy_clock", word)

    def wait_open(self, timeout_s: float) -> ChannelState | None:
        """Block until a window is open (or timeout); None on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.state()
            if st.open:
                return st
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self._fifo], [], [], left)
            if ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._fifo, 4096)

    def count_slice(self) -> None:
        self._add("slices", 1)

    def close(self) -> None:
        self._close_stat()
        with contextlib.suppress(Exception):
            self._mm.close()
        with contextlib.suppress(Exception):
            self._file.close()
        with contextlib.suppress(OSError):
            os.close(self._fifo)
