"""Background upload of a rank's staged checkpoint files.

Runs on one daemon thread per worker, so uploads of step N finish before those
of step N+1 start (the controller relies on that order when it sweeps abandoned
steps). It must never block the training thread: `submit` only enqueues.
"""

from __future__ import annotations

import queue
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from spotline.checkpoint import CheckpointStore, FileEntry


@dataclass
class UploadResult:
    step: int
    rank: int
    files: list[FileEntry] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None


class Uploader:
    def __init__(
        self,
        store: CheckpointStore,
        rank: int,
        world_size: int,
        max_bytes_per_s: float | None = None,
    ):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.max_bytes_per_s = max_bytes_per_s
        self._todo: queue.Queue[tuple[int, Path] | None] = queue.Queue()
        self._done: list[UploadResult] = []
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self._thread = threading.Thread(
            target=self._loop, name=f"spotline-upload-{rank}", daemon=True
        )
        self._thread.start()

    def submit(self, step: int, local_dir: Path) -> None:
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._todo.put((step, local_dir))

    def take_done(self) -> list[UploadResult]:
        with self._lock:
            out, self._done = self._done, []
        return out

    def flush(self, timeout_s: float) -> list[UploadResult]:
        """Wait until every submitted upload finished (or failed), then take results."""
        if not self._idle.wait(timeout_s):
            raise TimeoutError(
                f"rank {self.rank}: checkpoint upload to {self.store.uri} did not finish in "
                f"{timeout_s:.0f}s; check the storage endpoint's bandwidth, or raise "
                "SPOTLINE_UPLOAD_FLUSH_TIMEOUT_S"
            )
        return self.take_done()

    def _loop(self) -> None:
        while True:
            item = self._todo.get()
            if item is None:
                return
            step, local_dir = item
            t0 = time.perf_counter()
            try:
                files = self.store.upload_dir(local_dir, step, max_bytes_per_s=self.max_bytes_per_s)
                self.store.write_receipt(step, self.rank, self.world_size, files)
                result = UploadResult(step, self.rank, files, time.perf_counter() - t0)
                shutil.rmtree(local_dir, ignore_errors=True)
            except Exception as e:  # noqa: BLE001 - reported to the controller, never raised here
                result = UploadResult(
                    step,
                    self.rank,
                    seconds=time.perf_counter() - t0,
                    error=f"{type(e).__name__}: {e}",
                )
            with self._lock:
                self._done.append(result)
                self._pending -= 1
                if self._pending == 0:
                    self._idle.set()
