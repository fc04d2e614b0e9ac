"""Prefetch: build step k+1's micro-batches on a background thread while step k runs.

    with Prefetcher(lambda k: sampler.micro_batches(k, replica, replicas, m)) as pf:
        for step in range(start, end):
            batches, stall_s = pf.get(step)   # stall_s: how long the step waited for data

One thread, at most one batch ahead. `get(k)` after `get(k - 1)` takes the batch the
thread built; any other step (the first, a rewind after a restore) is built on demand.
An exception raised while building is raised by the `get` of that step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")


class Prefetcher(Generic[T]):
    def __init__(
        self,
        make: Callable[[int], T],
        enabled: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.make = make
        self.enabled = enabled
        self._clock = clock  # what a stall is measured on
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: tuple[int, Future[T]] | None = None
        self._lock = threading.Lock()
        self._closed = False

    def get(self, step: int) -> tuple[T, float]:
        """Step `step`'s batches and the seconds this call waited for them; then starts
        building step + 1."""
        t0 = self._clock()
        with self._lock:
            if self._closed:
                raise RuntimeError("Prefetcher.get after close()")
            if not self.enabled:
                out = self.make(step)
                return out, self._clock() - t0
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="spotline-prefetch")
            ahead, self._ahead = self._ahead, None
            if ahead is not None and ahead[0] == step:
                fut = ahead[1]
            else:
                if ahead is not None:
                    ahead[1].cancel()  # another step was asked for: drop it
                fut = self._pool.submit(self.make, step)
            out = fut.result()  # re-raises the builder's exception here
            stall = self._clock() - t0
            self._ahead = (step + 1, self._pool.submit(self.make, step + 1))
            return out, stall

    def close(self) -> None:
        """Stop: drop the batch built ahead and let the thread finish."""
        with self._lock:
            self._closed = True
            if self._ahead is not None:
                self._ahead[1].cancel()
                self._ahead = None
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
