"""The backfill governor: a measured baseline, and a bounded slowdown."""

from __future__ import annotations

import pytest

from spotline.backfill.governor import MAX_MARGIN, START_MARGIN, SlowdownGovernor

pytestmark = pytest.mark.unit


def gov(**kw):
    args = {"max_slowdown": 0.02, "baseline_steps": 20, "rebaseline_every_steps": 1000}
    return SlowdownGovernor(**(args | kw))


def test_starts_paused_and_measures_its_own_baseline():
    g = gov()
    assert g.decision().paused and g.decision().phase == "baseline"
    g.observe(10, 1.0)
    assert g.decision().paused  # 10 of 20 baseline steps
    d = g.observe(10, 1.2)
    assert not d.paused and d.phase == "on" and d.margin == START_MARGIN
    assert g.baseline_s == pytest.approx(0.11)  # median of the chunks' step times


def test_unwarm_chunks_are_ignored():
    g = gov()
    g.observe(10, 50.0, warm=False)
    assert g.baseline_s is None and g.decision().phase == "baseline"


def test_too_slow_widens_the_margin_then_pauses():
    g = gov()
    g.observe(20, 2.0)  # baseline 0.1 s/step
    margins = []
    for _ in range(12):
        d = g.observe(10, 1.1)  # 10% slower, above the 2% bound
        margins.append(d.margin)
        if d.paused:
            break
    assert d.paused and d.phase == "paused"
    assert max(margins) == MAX_MARGIN
    assert margins == sorted(margins)  # only ever widened
    assert g.slowdown == pytest.approx(0.10)


def test_within_bound_relaxes_toward_full_windows():
    g = gov()
    g.observe(20, 2.0)
    for _ in range(3):
        d = g.observe(10, 1.0)  # no slowdown at all
    assert not d.paused and d.margin < START_MARGIN
    for _ in range(30):
        d = g.observe(10, 1.0)
    assert d.margin == 1.0


def test_slowdown_inside_the_bound_keeps_the_margin():
    g = gov()
    g.observe(20, 2.0)
    for _ in range(6):
        d = g.observe(10, 1.015)  # 1.5%: under 2%, above half of it
    assert d.margin == START_MARGIN and not d.paused


def test_rebaselines_periodically_and_unpauses():
    g = gov(rebaseline_every_steps=200)
    g.observe(20, 2.0)
    steps = 0
    while not g.decision().paused:
        g.observe(10, 2.0)  # 100% slower: widen, widen, ... pause
        steps += 10
    assert steps < 200
    while steps < 200:
        assert g.decision().phase == "paused"
        g.observe(10, 1.0)
        steps += 10
    assert g.decision().phase == "baseline"  # 200 steps since the last baseline
    g.observe(20, 3.0)  # the machine got slower: new baseline 0.15 s/step
    assert g.decision().phase == "on" and g.baseline_s == pytest.approx(0.15)
    d = g.observe(10, 1.5)
    assert not d.paused
