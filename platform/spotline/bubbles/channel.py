"""The trainer -> backfill executor signal: a 64-byte shared page and a FIFO.

A stage and its executor run in two processes on one node and share a device.
The trainer must pay almost nothing per window, so it writes a few integers into
an mmap'ed file and one byte into a FIFO (no Ray call, no lock, no syscall it
could block in). The executor sleeps in `select` on the FIFO and, once woken,
reads the page: is the window still open, and until when is it predicted to
last. The executor writes back how long it worked inside windows, which the
trainer reports with its step timings (that is the fill fraction).

Both sides use CLOCK_MONOTONIC, which is one clock for every process of a node.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import struct
import time
from dataclasses import dataclass
from pathlib import Path

_FIELDS = (
    "seq",  # windows opened so far
    "open",  # 1 while the stage waits
    "predicted_end_ns",  # when the open window should close
    "closed_ns",  # when the last window closed
    "filled_ns",  # executor: time worked inside windows
    "overrun_ns",  # executor: time worked after a window closed
    "slices",  # executor: units of work run
)
_FMT = "<" + "q" * len(_FIELDS)
_RING = 16  # close times of the last windows, by seq % _RING
_RING_OFF = struct.calcsize(_FMT)
_SIZE = _RING_OFF + 8 * _RING
_OFF = {name: 8 * i for i, name in enumerate(_FIELDS)}


@dataclass(frozen=True)
class ChannelState:
    seq: int
    open: int
    predicted_end_ns: int
    closed_ns: int
    filled_ns: int
    overrun_ns: int
    slices: int


class WindowChannel:
    """One side of a rank's channel. `create=True` on the trainer, False on the executor."""

    def __init__(self, path: str | os.PathLike[str], create: bool = False):
        self.path = Path(path)
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

    def _get(self, name: str) -> int:
        return struct.unpack_from("<q", self._mm, _OFF[name])[0]

    def _set(self, name: str, value: int) -> None:
        struct.pack_into("<q", self._mm, _OFF[name], value)

    def _add(self, name: str, value: int) -> None:
        self._set(name, self._get(name) + value)

    def state(self) -> ChannelState:
        return ChannelState(*struct.unpack_from(_FMT, self._mm, 0))

    # --- trainer side -----------------------------------------------------------

    def open_window(self, predicted_s: float) -> None:
        self._set("predicted_end_ns", time.monotonic_ns() + int(predicted_s * 1e9))
        self._set("open", 1)
        self._set("seq", self._get("seq") + 1)
        with contextlib.suppress(BlockingIOError):  # a full FIFO: the executor is behind
            os.write(self._fifo, b"w")

    def close_window(self) -> None:
        now = time.monotonic_ns()
        struct.pack_into("<q", self._mm, _RING_OFF + 8 * (self._get("seq") % _RING), now)
        self._set("closed_ns", now)
        self._set("open", 0)

    # --- executor side ----------------------------------------------------------

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

    def closed_at(self, seq: int) -> int | None:
        """When window `seq` closed; None if it is still open or too old to know."""
        st = self.state()
        if seq == st.seq and st.open:
            return None
        if st.seq - seq >= _RING:
            return None
        return struct.unpack_from("<q", self._mm, _RING_OFF + 8 * (seq % _RING))[0]

    def account(self, filled_ns: int, overrun_ns: int, slices: int = 1) -> None:
        self._add("filled_ns", filled_ns)
        self._add("overrun_ns", overrun_ns)
        self._add("slices", slices)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._mm.close()
        with contextlib.suppress(Exception):
            self._file.close()
        with contextlib.suppress(OSError):
            os.close(self._fifo)
