"""Python's automatic garbage collection, held back over a burst of allocations.

A controller of thousands of ranks builds tens of thousands of containers in one poll
(every rank's report, and what the books make of it) and in one manifest's JSON. None
of them forms a cycle, and almost all of them are gone when the burst ends. Collected in
the middle of it, they survive the young collections, are counted as old, and trip a
collection of the whole heap (with S3's client and torch loaded, it costs more than the
poll of 8,192 ranks itself; benchmarks/README.md has the figures). Held back, they die by
reference count when the burst ends; collections resume after it, with the counts it
left, and find only what outlived it.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0  # bursts in progress, on any thread
_resume = False  # whether collection was on when the first of them began


@contextlib.contextmanager
def collection_held() -> Iterator[None]:
    """Hold back automatic collection while the block runs. Safe to nest and to enter
    from several threads at once: collection resumes when the last block leaves, and
    only if it was on when the first one entered (a program that turned it off keeps it
    off)."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
