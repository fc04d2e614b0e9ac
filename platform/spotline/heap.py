"""Python's automatic garbage collection, held back over a burst of allocations.

A controller of thousands of ranks builds tens of thousands of containers in one poll
(every rank's report, and what the books make of it) and in one manifest's JSON. None
of them forms a cycle, and almost all of them are gone when the burst ends. Collected in
the middle of it, they survive the young collections, are counted as old, and trip a
collection of the whole heap (with S3's client and torch loaded, it costs more than the
poll of 8,192 ranks itself; benchmarks/README.md has the figures). Held back, they die by
reference count when the burst ends; collections resume after it, with the counts it
left, and find only what outlived it.

Held only around the CPU-bound part of such work: building the poll's snapshot from
the reports `ray.wait` already brought in, a manifest's JSON either way, the peer-memory
offer from holdings already received. Never across a wait on Ray or storage (the ranks'
wait, a write, a keeper's call with its timeout, `ray.nodes()`): the cycles that do form
meanwhile (botocore's clients, tracebacks of failed calls) would pile up for as long as
the wait lasts, and a burst held that long is no burst. tests/test_heap.py watches the
controller's loop for a wait made while collection is held.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_depth = 0  # bursts in progress, on any thread
_resume = False  # whether collection was on when the first of them began
_mine = threading.local()  # this thread's bursts in progress


class _Held:
    """The one block object: entering it allocates nothing the collector tracks, so
    that entering it right after a burst ended (one step of the poll after another)
    does not itself set off the young collection that the burst's leftovers would
    make costly."""

    def __enter__(self) -> None:
        global _depth, _resume
        with _lock:
            if _depth == 0:
                _resume = gc.isenabled()
                gc.disable()
            _depth += 1
        _mine.depth = getattr(_mine, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        global _depth
        _mine.depth -= 1
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()


_HELD = _Held()


def collection_held() -> _Held:
    """Hold back automatic collection while the block (`with collection_held():`)
    runs. Safe to nest and to enter from several threads at once: collection resumes
    when the last block leaves, and only if it was on when the first one entered (a
    program that turned it off keeps it off)."""
    return _HELD


def held() -> bool:
    """Whether this thread is inside a block that holds automatic collection back."""
    return getattr(_mine, "depth", 0) > 0
