"""The bubble window channel between two processes: the trainer's side opens a window
and an executor's process, waiting on it, wakes and accounts its slice."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from spotline.bubbles import WindowChannel

pytestmark = pytest.mark.procs


def _executor_side(path, q):
    chan = WindowChannel(path)
    q.put(("waiting", chan.state().open))  # about to wait: the window is still closed
    st = chan.wait_open(10.0)
    q.put(None if st is None else (st.seq, st.open))
    chan.count_slice()
    q.put("accounted")


def test_channel_wakes_the_other_process(tmp_path):
    path = tmp_path / "window.chan"
    chan = WindowChannel(path, create=True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_executor_side, args=(str(path), q))
    proc.start()
    assert q.get(timeout=60) == ("waiting", 0)  # the other side waits before it opens
    chan.open_window(0.05)
    assert q.get(timeout=30) == (1, 1)
    assert q.get(timeout=30) == "accounted"
    chan.close_window()
    proc.join(timeout=30)
    st = chan.state()
    assert (st.open, st.slices) == (0, 1)
    assert st.closed_ns > st.opened_ns > 0
    chan.open_window(0.05)
    assert chan.wait_open(0.05).seq == 2
    chan.close_window()
    assert chan.wait_open(0.05) is None  # closed: nothing to wait for
    assert chan.state().closed_ns > st.closed_ns
