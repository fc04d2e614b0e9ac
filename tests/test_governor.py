"""The backfill governor: a measured baseline, and a bounded slowdown."""

from __future__ import annotations

import random

import pytest

from spotline.backfill.governor import MAX_MARGIN, START_MARGIN, SlowdownGovernor, Z

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


def test_a_slowdown_surely_under_the_bound_relaxes_the_margin():
    g = gov()
    g.observe(20, 2.0)
    for _ in range(3):
        d = g.observe(10, 1.015)  # 1.5%, every chunk: under 2% for sure
    assert d.margin < START_MARGIN and not d.paused


def test_a_slowdown_not_surely_over_or_under_the_bound_holds_the_margin():
    g = gov()
    g.observe(20, 2.0)
    for i in range(12):
        d = g.observe(10, 1.0 if i % 2 else 1.03)  # 1.5% on average, +-1.5% chunk to chunk
    assert d.margin == START_MARGIN and not d.paused
    assert g.slowdown == pytest.approx(0.015)
    assert g.slowdown + Z * g.slowdown_se > g.max_slowdown > g.slowdown - Z * g.slowdown_se


def _noisy(g, rng, chunks, slowdown=0.0, sigma=0.05):
    """Chunks of 10 steps at 0.1 s/step, `slowdown` slower while backfill runs, each
    chunk's mean off by a normal error of `sigma`; the decisions taken."""
    out = []
    for _ in range(chunks):
        on = not g.decision().paused
        per_step = 0.1 * (1 + (slowdown if on else 0.0)) * (1 + rng.gauss(0.0, sigma))
        out.append(g.observe(10, 10 * per_step))
    return out


SEEDS = range(20)


def test_noise_alone_neither_pauses_backfill_nor_ratchets_the_margin():
    """Chunk-to-chunk noise of 5% (2.5x the bound) and no slowdown at all, over 20
    seeded runs of 300 chunks. A governor that answered each reading paused backfill
    for 2,232 of these chunks and held a mean margin of 4.5."""
    margins, paused = [], 0
    for seed in SEEDS:
        g = gov(baseline_steps=40)  # 4 chunks
        for d in _noisy(g, random.Random(seed), 4 + 300)[4:]:
            margins.append(d.margin)
            paused += d.phase == "paused"
    assert paused == 0
    assert sum(margins) / len(margins) < 2.0


def test_a_real_slowdown_is_found_through_the_noise():
    """10% slower with backfill on, through the same noise: every run widens the margin
    (never relaxing it) until backfill pauses."""
    for seed in SEEDS:
        g = gov(baseline_steps=40)
        decisions = _noisy(g, random.Random(seed), 4 + 300, slowdown=0.10)[4:]
        first = next(i for i, d in enumerate(decisions) if d.phase == "paused")
        margins = [d.margin for d in decisions[: first + 1]]
        assert margins == sorted(margins) and margins[-1] == MAX_MARGIN, seed
