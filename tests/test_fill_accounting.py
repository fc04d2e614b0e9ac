"""Fill and overrun, measured against scripted windows: known windows, known unit costs,
exact expected figures; and the executor's rule for which unit may start where."""

from __future__ import annotations

import threading
import time

import pytest

from spotline.backfill.executor import UnitScheduler
from spotline.bubbles.book import BubbleBook
from spotline.bubbles.channel import (
    BUSY_CLOCK,
    BUSY_THREAD,
    ChannelState,
    FillMeter,
    WindowChannel,
)

pytestmark = pytest.mark.unit

MS = 1_000_000  # ns


def _state(seq: int, opened_ms: float, predicted_ms: float) -> ChannelState:
    return ChannelState(
        seq=seq,
        open=1,
        predicted_end_ns=int((opened_ms + predicted_ms) * MS),
        closed_ns=0,
        filled_ns=0,
        overrun_ns=0,
        slices=0,
        opened_ns=int(opened_ms * MS),
        open_ns=0,
        busy_mode=BUSY_CLOCK,
        busy_pid=0,
        busy_tid=0,
        busy_clock=0,
        beyond_ns=0,
    )


def _replay(windows, cost_ms, sched: UnitScheduler, step_ms=(0.0, 100.0)):
    """Play one step: at each window's open the executor starts units back to back while
    the scheduler lets it; a unit that starts runs to its end, window or not. Returns the
    meter and the units' (start, end) in ms."""
    units: list[tuple[float, float]] = []
    t_free = 0.0  # when the executor is next free
    for seq, (opened, closed, predicted) in enumerate(windows, start=1):
        st = _state(seq, opened, predicted)
        t = max(opened, t_free)
        while t < closed and sched.fits("u", st, int(t * MS)):
            units.append((t, t + cost_ms))
            t += cost_ms
        t_free = t

    def busy(at_ms: float) -> int:
        return int(sum(max(0.0, min(e, at_ms) - s) for s, e in units) * MS)

    meter = FillMeter()
    meter.step_begin(busy(step_ms[0]))
    for opened, closed, predicted in windows:
        meter.window_open(int(opened * MS), busy(opened), int((opened + predicted) * MS))
        meter.window_close(int(closed * MS), busy(closed))
    meter.step_end(busy(step_ms[1]))
    return meter, units


def test_scripted_windows_give_exact_fill_and_overrun():
    sched = UnitScheduler(margin=1.0)
    sched.learn("u", 1.0)  # the warm-up run: not a forecast
    sched.learn("u", 0.004)  # every unit costs 4 ms
    # (open, close, predicted length) in ms. The second window is forecast at 8 ms but
    # closes after 6: its second unit (54-58) runs 2 ms past the close.
    windows = [(10, 30, 20), (50, 56, 8), (80, 90, 10)]
    meter, units = _replay(windows, 4.0, sched)
    assert units == [
        (10, 14),
        (14, 18),
        (18, 22),
        (22, 26),
        (26, 30),
        (50, 54),
        (54, 58),
        (80, 84),
        (84, 88),  # at 88 only 2 ms are left: no third unit
    ]
    assert meter.filled_ns == (20 + 6 + 8) * MS
    assert meter.overrun_ns == 2 * MS
    assert meter.open_ns == (20 + 6 + 10) * MS
    assert meter.beyond_ns == 0  # no window outlasted its forecast


def test_a_window_that_outlasts_its_forecast_is_counted_as_such():
    sched = UnitScheduler(margin=1.0)
    sched.learn("u", 1.0)  # warm-up
    sched.learn("u", 0.004)
    # Forecast 12 ms, open 20: units start at 10, 14 and 18 (exactly 4 ms of forecast
    # left); at 22 the forecast has ended though the window is open until 30.
    meter, units = _replay([(10, 30, 12)], 4.0, sched)
    assert units == [(10, 14), (14, 18), (18, 22)]
    assert meter.filled_ns == 12 * MS and meter.overrun_ns == 0
    assert meter.beyond_ns == 8 * MS  # 22..30: open, but past the forecast


def test_the_margin_keeps_units_out_of_tight_windows():
    sched = UnitScheduler(margin=2.0)
    sched.learn("u", 1.0)  # warm-up
    sched.learn("u", 0.004)  # needs 8 ms of room
    meter, units = _replay([(10, 30, 20), (50, 56, 6)], 4.0, sched)
    # 10, 14, 18 and 22 leave >= 8 ms; at 26 only 4 are left. The 6 ms window fits none.
    assert units == [(10, 14), (14, 18), (18, 22), (22, 26)]
    assert meter.filled_ns == 16 * MS and meter.overrun_ns == 0
    assert meter.open_ns == 26 * MS


def test_busy_time_outside_windows_and_outside_steps():
    meter = FillMeter()
    # Busy 5 ms before the step (not the stage's time), then 3 ms in the step with no
    # window open: overrun; then 4 ms inside a window.
    meter.step_begin(5 * MS)
    meter.window_open(20 * MS, 8 * MS)
    meter.window_close(30 * MS, 12 * MS)
    meter.step_end(12 * MS)
    assert (meter.filled_ns, meter.overrun_ns, meter.open_ns) == (4 * MS, 3 * MS, 10 * MS)
    # No busy source yet (the executor has not attached): windows count, busy does not.
    meter.step_begin(None)
    meter.window_open(40 * MS, None)
    meter.window_close(45 * MS, None)
    meter.step_end(None)
    assert (meter.filled_ns, meter.overrun_ns, meter.open_ns) == (4 * MS, 3 * MS, 15 * MS)


def test_no_unit_is_forced_and_one_that_fits_no_window_says_why():
    sched = UnitScheduler(margin=1.0)
    sched.learn("big", 0.030)  # warm-up
    sched.learn("big", 0.030)
    ran = 0
    for seq in range(1, 41):  # 40 windows of 10 ms, each seen at its opening
        st = _state(seq, seq * 100.0, 10.0)
        ran += sched.fits("big", st, int(seq * 100.0 * MS))
    assert ran == 0  # never forced, however many windows passed
    why = sched.deferral("big")
    assert why is not None
    assert why["cost_s"] == pytest.approx(0.030) and why["longest_window_s"] == pytest.approx(0.01)
    assert "free time after training" in why["why"]
    # A window it fits comes along: it runs there.
    assert sched.fits("big", _state(41, 5000.0, 40.0), int(5000.0 * MS))


def test_unmeasured_kind_starts_only_near_the_start_of_a_typical_window():
    sched = UnitScheduler(margin=1.0)
    for seq in range(1, 5):
        sched.fits("u", _state(seq, seq * 100.0, 10.0), int(seq * 100.0 * MS))
    st = _state(5, 500.0, 10.0)
    assert not sched.fits("new", st, int(503.0 * MS))  # 7 ms left of a 10 ms window
    assert sched.fits("new", _state(6, 600.0, 10.0), int(601.0 * MS))  # 9 ms left


def test_a_slow_first_run_does_not_lock_its_kind_out_of_the_windows():
    """The first run of a kind pays one-time costs (here: 960 ms, an optimizer's first
    construction importing torch's compiler stack). Taken as the kind's cost, no 10 ms
    window would ever fit it again, and it could never be measured anew."""
    sched = UnitScheduler(margin=1.0)
    windows = [_state(seq, seq * 100.0, 10.0) for seq in range(1, 21)]
    for st in windows[:16]:
        sched.fits("u", st, int(st.opened_ns))
    sched.learn("u", 0.960)
    assert sched.cost_s("u") is None and sched.deferral("u") is None
    st = windows[16]
    assert sched.fits("u", st, int(st.opened_ns))  # measured again, as a new kind
    sched.learn("u", 0.002)
    assert sched.cost_s("u") == pytest.approx(0.002)
    assert sched.fits("u", windows[17], int(windows[17].opened_ns + 7 * MS))  # 3 ms left


def test_cost_is_the_median_of_recent_units_and_the_budget_follows_windows():
    sched = UnitScheduler(margin=2.0)
    assert sched.budget_s() is None
    for s in (2.0, 0.001, 0.001, 0.050, 0.001, 0.001):  # a warm-up, then one slow outlier
        sched.learn("u", s)
    assert sched.cost_s("u") == pytest.approx(0.001)
    for seq, length in enumerate((4.0, 6.0, 8.0), start=1):
        sched.fits("u", _state(seq, seq * 100.0, length), int(seq * 100.0 * MS))
    assert sched.budget_s() == pytest.approx(0.006 / 2.0)


def test_channel_meters_the_busy_clock(tmp_path):
    now = [0]
    trainer = WindowChannel(tmp_path / "w.chan", create=True, clock_ns=lambda: now[0])
    executor = WindowChannel(tmp_path / "w.chan")
    executor.publish_busy_source(BUSY_CLOCK)
    done = 0

    def unit(start_ms: float, end_ms: float) -> None:
        nonlocal done
        executor.set_busy_clock(done - int(start_ms * MS))  # running since start
        yield
        done += int((end_ms - start_ms) * MS)
        executor.set_busy_clock(done)

    now[0] = 0
    trainer.step_begin()
    now[0] = 10 * MS
    trainer.open_window(0.010)
    u = unit(12, 25)
    next(u)
    now[0] = 20 * MS
    trainer.close_window()  # mid-unit: 8 ms of it inside the window
    now[0] = 25 * MS
    next(u, None)
    now[0] = 40 * MS
    trainer.step_end()
    st = trainer.state()
    assert (st.filled_ns, st.overrun_ns, st.open_ns) == (8 * MS, 5 * MS, 10 * MS)
    trainer.close()
    executor.close()


def test_channel_reads_the_executor_threads_cpu_time_from_the_kernel(tmp_path):
    trainer = WindowChannel(tmp_path / "t.chan", create=True)
    executor = WindowChannel(tmp_path / "t.chan")
    go_inside, inside_done = threading.Event(), threading.Event()
    go_outside, outside_done = threading.Event(), threading.Event()
    finish = threading.Event()

    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    def work() -> None:
        import os

        executor.publish_busy_source(BUSY_THREAD, os.getpid(), threading.get_native_id())
        go_inside.wait()
        burn(0.05)
        inside_done.set()
        go_outside.wait()
        burn(0.03)
        outside_done.set()
        finish.wait()  # alive until the trainer's last read

    t = threading.Thread(target=work)
    t.start()
    while trainer.state().busy_mode != BUSY_THREAD:
        time.sleep(0.001)
    trainer.step_begin()
    trainer.open_window(1.0)
    go_inside.set()
    assert inside_done.wait(30)
    trainer.close_window()
    go_outside.set()
    assert outside_done.wait(30)
    trainer.step_end()
    finish.set()
    t.join()
    st = trainer.state()
    # The kernel's count of the thread's CPU time: at least what it burnt, and a
    # single thread cannot be busy longer than the window was open.
    assert 0.05 <= st.filled_ns / 1e9 <= st.open_ns / 1e9
    assert 0.03 <= st.overrun_ns / 1e9 < 0.03 + 0.02
    trainer.close()
    executor.close()


def test_book_reports_fill_over_windows_and_never_caps_it():
    book = BubbleBook(stages=2)
    rows = [
        {"stage": 0, "rank": 0, "steps": 10, "step_s": 10.0, "wait_s": 2.0, "window_s": 1.5},
        {"stage": 1, "rank": 1, "steps": 10, "step_s": 10.0, "wait_s": 4.0, "window_s": 4.0},
    ]
    rows[0] |= {"filled_s": 1.2, "overrun_s": 0.1}
    rows[1] |= {"filled_s": 3.0, "overrun_s": 0.3}
    book.add(rows, micro_batches=4)
    s = book.summary()
    assert s["theory"] == pytest.approx(0.2)
    assert s["bubble_fraction"] == pytest.approx(6.0 / 20.0)
    assert s["fill_fraction"] == pytest.approx(4.2 / 5.5)
    assert s["bubble_fill_fraction"] == pytest.approx(4.2 / 6.0)
    assert s["per_stage"][0]["fill_fraction"] == pytest.approx(0.8)
    assert s["overrun_fraction"] == pytest.approx(0.4 / 20.0)
    assert s["overrun_s_per_step"] == pytest.approx(0.4 / 20)
    # A broken measurement that claims more busy time than window time shows as such.
    bad = BubbleBook(stages=2)
    bad.add(
        [{"stage": 0, "rank": 0, "steps": 1, "step_s": 1.0, "window_s": 0.1, "filled_s": 0.3}], 2
    )
    assert bad.summary()["fill_fraction"] == pytest.approx(3.0)
