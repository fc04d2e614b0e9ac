"""Automatic garbage collection held back over a burst of allocations (`spotline.heap`):
held while a block runs, back on when the last block leaves, and never turned on for a
program that turned it off; and never held across a wait in the controller's loop."""

from __future__ import annotations

import concurrent.futures
import gc
import queue
import socket
import sys
import threading
from pathlib import Path

import pytest

from spotline.heap import collection_held, held

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _collection_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_collection_is_held_in_the_block_and_back_on_after_it():
    with collection_held():
        assert not gc.isenabled()
        with collection_held():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer block still runs
    assert gc.isenabled()


def test_collection_is_back_on_after_a_block_that_raises():
    with pytest.raises(RuntimeError), collection_held():
        raise RuntimeError("a failed poll")
    assert gc.isenabled()


def test_a_program_that_turned_collection_off_keeps_it_off():
    gc.disable()
    with collection_held():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_collection_stays_held_until_the_last_thread_leaves():
    entered, leave = threading.Event(), threading.Event()
    seen: list[bool] = []

    def second() -> None:
        with collection_held():
            entered.set()
            leave.wait(5)
            seen.append(gc.isenabled())

    thread = threading.Thread(target=second)
    with collection_held():  # the first block, on this thread
        thread.start()
        assert entered.wait(5)
    assert not gc.isenabled()  # the first block left; the second still runs
    leave.set()
    thread.join(5)
    assert seen == [False] and gc.isenabled()


def test_held_is_true_only_in_this_threads_block():
    assert not held()
    with collection_held():
        assert held()
        other: list[bool] = []
        thread = threading.Thread(target=lambda: other.append(held()))
        thread.start()
        thread.join(5)
        assert other == [False]  # collection is held, but not by that thread
    assert not held()


# --- no wait while collection is held --------------------------------------------------

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

_WAIT_FUNCTIONS = {
    ("time", "sleep"),
    ("io", "open"),  # a file opened: storage on file://
    ("posix", "replace"),
    ("posix", "rename"),
    ("posix", "fsync"),
    ("posix", "write"),
    ("select", "select"),
}
_SOCKET_CALLS = {"recv", "recv_into", "send", "sendall", "connect", "connect_ex", "accept"}


def _wait_codes() -> dict[object, str]:
    import scale_sim

    waits = {
        threading.Condition.wait: "Condition.wait",
        threading.Event.wait: "Event.wait",
        threading.Thread.join: "Thread.join",
        queue.Queue.get: "Queue.get",
        concurrent.futures.Future.result: "Future.result",
        concurrent.futures.wait: "concurrent.futures.wait",
        scale_sim.SimClock.sleep: "the group's wait for its ranks",
    }
    return {fn.__code__: name for fn, name in waits.items()}


def _watch_waits(run, calls: dict[str, str] | None = None) -> tuple[list[str], list[str]]:
    """Run `run()` on this thread; every wait it made (a sleep, a lock or future waited
    on, a file opened or written, a socket used, a call of a function named in `calls`),
    and those made while this thread held automatic collection back."""
    codes = _wait_codes()
    calls = calls or {}
    seen: list[str] = []
    held_waits: list[str] = []

    def hook(frame, event, arg) -> None:
        what = None
        if event == "call":
            what = codes.get(frame.f_code) or calls.get(frame.f_code.co_name)
        elif event == "c_call":
            owner = getattr(arg, "__self__", None)
            name = getattr(arg, "__name__", None)
            if (getattr(arg, "__module__", None), name) in _WAIT_FUNCTIONS:
                what = f"{arg.__module__}.{name}"
            elif isinstance(owner, socket.socket) and name in _SOCKET_CALLS:
                what = f"socket.{name}"
        if what is None:
            return
        seen.append(what)
        if held():
            where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
            held_waits.append(f"{what} (from {where})")

    sys.setprofile(hook)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen, held_waits


@pytest.fixture
def benchmarks_on_path():
    sys.path.insert(0, str(BENCHMARKS))
    yield
    sys.path.remove(str(BENCHMARKS))


def test_the_controller_loop_waits_on_nothing_while_collection_is_held(
    tmp_path, benchmarks_on_path
):
    """The controller's loop over simulated ranks (`benchmarks/scale.py`): its polls,
    each waiting for the ranks, and a commit written to file://. The snapshot is built
    with collection held; no wait runs inside that (a wait there would leave the cycles
    that do form, botocore's and tracebacks', uncollected for as long as it lasts)."""
    import scale

    seen, held_waits = _watch_waits(lambda: scale.measure_loop(16, tmp_path))
    assert "the group's wait for its ranks" in seen  # the watch sees the waits
    assert "io.open" in seen  # the commit's writes
    assert held_waits == []


def test_the_peer_offer_asks_the_keepers_with_collection_on(benchmarks_on_path):
    """The offer folds thousands of ranks' holdings with collection held; the keepers'
    call that brings them (`PeerMemory._ask`, with its timeout) runs with it on."""
    import scale

    seen, held_waits = _watch_waits(
        lambda: scale.measure_peer(16), calls={"_ask": "the keepers' call"}
    )
    assert "the keepers' call" in seen
    assert held_waits == []
