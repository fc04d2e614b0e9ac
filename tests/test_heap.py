"""Automatic garbage collection held back over a burst of allocations (`spotline.heap`):
held while a block runs, back on when the last block leaves, and never turned on for a
program that turned it off."""

from __future__ import annotations

import gc
import threading

import pytest

from spotline.heap import collection_held

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
