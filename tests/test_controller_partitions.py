"""Stage re-partitions through the controller (`repartition.py`): measured imbalance,
a restart that must pay, and a partition asked for. Against a fake group."""

from __future__ import annotations

import pytest

from controller_fakes import FakeGroup, _unequal, run_until

pytestmark = pytest.mark.unit


def test_balanced_stages_are_left_alone(tmp_path):
    ctl, _ = _unequal(tmp_path, [1.0, 1.0])
    res = ctl.run()
    assert res["state"] == "finished"
    assert len(FakeGroup.instances) == 1
    assert res["partition"]["measured_imbalance"] == pytest.approx(0.0)
    assert res["partition"]["repartitions"] == []


def test_no_repartition_when_the_restart_would_not_pay(tmp_path):
    ctl, _ = _unequal(tmp_path, [1.0, 0.5])
    run_until(ctl, lambda: ctl.step_count >= 5)
    ctl.pace.restart_s = 1e6  # a restart that costs more than the rest of the job
    res = ctl.run()
    assert len(FakeGroup.instances) == 1 and res["partition"]["repartitions"] == []


def test_below_the_threshold_no_repartition(tmp_path):
    # 1/3 imbalance, but the threshold is higher.
    ctl, _ = _unequal(tmp_path, [1.0, 0.5], **{"parallel.rebalance_threshold": 0.5})
    res = ctl.run()
    assert len(FakeGroup.instances) == 1 and res["partition"]["repartitions"] == []


def test_asked_repartition_happens_at_the_next_boundary(tmp_path):
    ctl, _ = _unequal(tmp_path, [1.0, 1.0], **{"parallel.partition": "uniform"})
    run_until(ctl, lambda: ctl.step_count >= 5)
    ctl.door.request_repartition([3, 9])  # not 8 layers: ignored with a warning
    ctl.step()
    assert any("ignored" in e for e in ctl.door.status()["events"])
    ctl.door.request_repartition([3, 5])
    ctl.run()
    assert [g.bounds for g in FakeGroup.instances] == [[0, 4, 8], [0, 3, 8]]
    assert FakeGroup.instances[1].restored == [50]


def test_sustained_imbalance_repartitions_at_the_next_checkpoint_boundary(tmp_path):
    ctl, store = _unequal(tmp_path, [1.0, 0.5])  # stage 1 runs at half the speed measured
    res = ctl.run()
    assert res["state"] == "finished"
    first, second = FakeGroup.instances
    assert first.bounds == [0, 4, 8] and second.started_partition == second.bounds
    assert second.bounds[1] > 4  # layers moved off the slow stage
    rp = res["partition"]["repartitions"]
    assert len(rp) == 1 and rp[0]["outcome"] == "done"
    # At a checkpoint boundary, through that checkpoint: the new group restored it.
    assert rp[0]["step"] % 50 == 0 and second.restored == [rp[0]["step"]]
    assert rp[0]["measured_imbalance"] == pytest.approx(1 / 3)
    assert rp[0]["measured_imbalance_after"] < rp[0]["measured_imbalance"]
    assert res["partition"]["bounds"] == second.bounds
    assert res["partition"]["measured_imbalance"] == rp[0]["measured_imbalance_after"]
    assert res["attempts"][0]["ended_by"] == "re-partition"
    assert store.load_manifest(400).extra["partition"] == second.bounds
    assert any("re-partition" in e for e in ctl.door.status()["events"])
    assert (
        ctl.door.trace() is None
        or ctl.door.trace()["otherData"]["partition"]["bounds"] == second.bounds
    )
