"""The goodput ledger and the deviation alerts (pure arithmetic, no Ray)."""

from __future__ import annotations

import pytest

from spotline.metrics.deviation import DeviationMonitor, likely_cause
from spotline.metrics.ledger import PARTS, GoodputLedger

pytestmark = pytest.mark.unit


def test_ledger_parts_sum_to_the_total_and_split_chunks_by_bubble_and_fill():
    led = GoodputLedger()
    led.charge("startup_other", 10.0, devices=4)  # 40
    led.train(100.0, devices=4, steps=50, bubble_fraction=0.25, fill_fraction=0.8)  # 400
    led.charge("checkpoint_stall", 2.0, devices=4)  # 8
    led.charge("recovery", 15.0, devices=2)  # 30
    led.charge("waiting", 20.0, devices=2)  # 40
    d = led.device_s
    assert d["useful"] == pytest.approx(300.0)
    assert d["bubble_filled"] == pytest.approx(80.0)
    assert d["bubble_unfilled"] == pytest.approx(20.0)
    assert led.total_s == pytest.approx(40 + 400 + 8 + 30 + 40)
    assert sum(d.values()) == pytest.approx(led.total_s)
    assert set(d) == set(PARTS)


def test_lost_steps_move_from_useful_to_recomputed():
    led = GoodputLedger()
    led.train(100.0, devices=2, steps=10)  # 20 device-s per step
    led.lost(3)
    assert led.device_s["useful"] == pytest.approx(140.0)
    assert led.device_s["recomputed"] == pytest.approx(60.0)
    assert led.steps == 7
    assert sum(led.device_s.values()) == pytest.approx(led.total_s)
    assert led.goodput() == pytest.approx(0.7)


def test_cost_on_spot_vs_the_same_steps_on_demand():
    led = GoodputLedger()
    led.train(3600.0, devices=8, steps=100)  # 8 device-hours of useful compute
    led.charge("recovery", 1800.0, devices=8)  # 4 device-hours lost to a restart
    cost = led.cost(spot_per_hour=1.0, on_demand_per_hour=4.0)
    assert cost["spot"] == pytest.approx(12.0)
    assert cost["on_demand_same_steps"] == pytest.approx(32.0)  # no restart on-demand
    assert led.cost(None, None) == {"spot": None, "on_demand_same_steps": None}


def test_ledger_round_trips_through_json_shape():
    led = GoodputLedger()
    led.train(10.0, devices=4, steps=5, bubble_fraction=0.2, fill_fraction=0.5)
    again = GoodputLedger.from_dict(led.to_dict())
    assert again == led
    with pytest.raises(KeyError, match="unknown ledger part 'nap'"):
        led.charge("nap", 1.0, 1)


def _monitor():
    return DeviationMonitor(threshold=0.15, sustain_steps=20, warmup_steps=10, baseline_steps=20)


def test_sustained_slowdown_alerts_once_with_the_cause():
    m = _monitor()
    for _ in range(3):  # 10 warm-up steps, then 20 baseline steps at 1 s/step
        assert m.observe(10, 10.0, tokens=1000, replicas=2, cause="?") == []
    assert m.baseline == {"step_s": 1.0, "tokens_per_s": 100.0}
    assert m.observe(10, 13.0, 1000, 2, "backfill") == []  # 30% slower, 10 steps
    alerts = m.observe(10, 13.0, 1000, 2, "backfill")
    assert {a.metric for a in alerts} == {"step time (s)", "tokens/s"}
    assert all(a.cause == "backfill" and a.steps == 20 for a in alerts)
    assert "30% worse than its baseline for 20 steps" in alerts[0].message()
    assert m.observe(10, 13.0, 1000, 2, "backfill") == []  # once per episode
    assert m.observe(10, 10.0, 1000, 2, "?") == []  # back to normal: re-armed
    m.observe(10, 13.0, 1000, 2, "x")
    assert len(m.observe(10, 13.0, 1000, 2, "x")) == 2


def test_short_blips_and_small_changes_do_not_alert():
    m = _monitor()
    for _ in range(3):
        m.observe(10, 10.0, 1000, 2, "?")
    for _ in range(5):
        assert m.observe(10, 11.0, 1000, 2, "?") == []  # 10%: under the threshold
        assert m.observe(10, 20.0, 1000, 2, "?") == []  # one bad chunk at a time
        assert m.observe(10, 10.0, 1000, 2, "?") == []


def test_fewer_replicas_is_named_as_the_cause():
    m = _monitor()
    for _ in range(3):
        m.observe(10, 10.0, 1000, 2, "?")
    m.observe(10, 20.0, 1000, 1, "unknown")
    alerts = m.observe(10, 20.0, 1000, 1, "unknown")
    assert alerts and alerts[0].cause.startswith("fewer replicas (1, baseline measured at 2)")


def test_likely_cause_prefers_what_is_measured():
    assert likely_cause(0.05, 0.02, None).startswith("backfill")
    assert likely_cause(0.01, 0.02, {0: 1.0, 1: 2.0}).startswith("a slow stage (stage 1")
    assert likely_cause(None, None, {0: 1.0, 1: 1.1}, uploading=True).startswith("checkpoint")
    assert likely_cause(None, None, {0: 1.0, 1: 1.1}).startswith("unknown")
