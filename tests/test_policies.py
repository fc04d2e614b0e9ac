"""Failure and scaling policies: plain decisions from plain inputs, no Ray."""

from __future__ import annotations

import pytest

from spotline import constants
from spotline.controller.policies import (
    Fail,
    FailurePolicy,
    GrowPolicy,
    Resize,
    Restart,
    ScalingPolicy,
    Wait,
    next_boundary,
)

pytestmark = pytest.mark.unit


def test_restarts_until_max_failures_then_fails() -> None:
    policy = FailurePolicy(max_failures=2)
    first = policy.decide(1, "worker 3 died")
    second = policy.decide(2, "worker 1 died")
    assert isinstance(first, Restart)
    assert isinstance(second, Restart)
    assert "1/2" in first.reason and "worker 3 died" in first.reason
    assert "2/2" in second.reason
    third = policy.decide(3, "OOM on rank 0")
    assert isinstance(third, Fail)
    assert "after 3 transient worker failures" in third.reason
    assert "failure.max_failures=2" in third.reason
    assert "OOM on rank 0" in third.reason


def test_unlimited_failures_never_fail() -> None:
    policy = FailurePolicy(max_failures=-1)
    for failures in (1, 2, 10, 10_000):
        decision = policy.decide(failures, "boom")
        assert isinstance(decision, Restart), failures
        assert "unlimited" in decision.reason


def test_zero_max_failures_fails_on_the_first() -> None:
    decision = FailurePolicy(max_failures=0).decide(1, "boom")
    assert isinstance(decision, Fail)
    assert "failure.max_failures=0" in decision.reason


@pytest.mark.parametrize(
    ("capacity", "expected"),
    [(10, Resize(4)), (5, Resize(4)), (4, Resize(4)), (3, Resize(3)), (2, Resize(2))],
)
def test_scaling_within_bounds(capacity: int, expected: Resize) -> None:
    assert ScalingPolicy(min_replicas=2, max_replicas=4).decide(capacity) == expected


@pytest.mark.parametrize("capacity", [0, 1])
def test_scaling_below_min_waits(capacity: int) -> None:
    decision = ScalingPolicy(min_replicas=2, max_replicas=4).decide(capacity)
    assert isinstance(decision, Wait)
    assert f"can hold {capacity} replica(s)" in decision.reason
    assert "elastic.min_replicas is 2" in decision.reason


def test_fixed_size_group() -> None:
    policy = ScalingPolicy(min_replicas=3, max_replicas=3)
    assert policy.decide(3) == Resize(3)
    assert policy.decide(8) == Resize(3)
    assert isinstance(policy.decide(2), Wait)


# --- growing --------------------------------------------------------------------------


def _grow(**kw):
    args = dict(
        replicas=1,
        capacity=2,
        steps_left=1000,
        steps_per_s=1.0,
        restart_s=60.0,
        running_s=1e6,
    )
    args.update(kw)
    return GrowPolicy(ScalingPolicy(1, 4)).decide(**args)


def test_grow_when_the_time_saved_beats_twice_the_restart_cost() -> None:
    # 1000 s left at 1 replica; at 2 it saves 500 s > 2 x 60 s.
    assert _grow() == Resize(2)
    assert _grow(capacity=9) == Resize(4)  # never above max_replicas


def test_no_grow_when_the_restart_costs_more_than_it_saves() -> None:
    # 200 s left; 2 replicas save 100 s, less than 2 x 60 s.
    assert _grow(steps_left=200) is None
    assert _grow(steps_left=250) == Resize(2)  # 125 s saved > 120 s


def test_no_grow_within_the_dwell_or_without_more_capacity() -> None:
    # The dwell is 2 x the measured restart cost (60 s): no fixed interval.
    assert _grow(running_s=119.0) is None
    assert _grow(running_s=121.0) == Resize(2)
    assert _grow(capacity=1) is None
    assert _grow(replicas=4, capacity=8) is None
    assert _grow(steps_per_s=0.0) is None


def test_grow_uses_the_rate_measured_at_the_bigger_size() -> None:
    # Measured before: 2 replicas ran no faster than 1 (a host-bound job): never worth it.
    assert _grow(measured={2: 1.0}) is None
    assert _grow(measured={2: 1.9}) == Resize(2)


def test_scaling_and_growing_pick_only_allowed_sizes() -> None:
    sizes = ScalingPolicy(1, 8, sizes=[1, 2, 4, 8])
    assert sizes.decide(7) == Resize(4)
    assert sizes.decide(8) == Resize(8)
    grow = GrowPolicy(sizes)
    args = dict(steps_left=1000, steps_per_s=1.0, restart_s=1.0, running_s=10.0)
    assert grow.decide(replicas=2, capacity=3, **args) is None  # 3 is not allowed
    assert grow.decide(replicas=2, capacity=5, **args) == Resize(4)


# --- the just-in-time checkpoint ----------------------------------------------------


def _jit(**over):
    from spotline.controller.notices import JitPolicy

    args = dict(step=100, seconds_left=120.0, step_s=1.0, save_s=10.0, replicas=3, replicas_after=2)
    args.update(over)
    return JitPolicy(margin_s=10.0).decide(**args)


def test_a_long_notice_stays_until_the_last_step_whose_save_fits() -> None:
    # AWS: 120 s, 10 s margin, 10 s save: 100 more steps at full size, then save.
    # Moving would give 1 + (2/3) x 109 = 73.7 steps at the smaller size: staying wins.
    assert _jit() == 200


def test_a_short_notice_moves_at_once() -> None:
    # GCP: 30 s: staying gains 10 steps, moving 1 + (2/3) x 19 = 13.7: move now.
    assert _jit(seconds_left=30.0) == 101
    # No time for a single step and a save: save after the next step, as before.
    assert _jit(seconds_left=15.0) == 101
    assert _jit(step_s=0.0) == 101  # nothing measured yet


def test_staying_pays_more_the_less_capacity_is_left() -> None:
    assert _jit(seconds_left=30.0, replicas_after=0) == 110  # nothing left: stay
    # A measured rate after the move beats the linear guess.
    assert _jit(seconds_left=60.0, rate_after=1.0) == 101
    assert _jit(seconds_left=60.0, rate_after=0.1) == 140


# --- does a just-in-time checkpoint fit the notice? -----------------------------------


def _spec(**over):
    from spotline.config import load_spec

    raw = {
        "name": "fit",
        "model": {
            "kind": "llama",
            "n_layers": 24,
            "d_model": 2048,
            "n_heads": 16,
            "vocab_size": 32000,
        },
        "parallel": {"pipeline_stages": 2, "micro_batches": 4, "precision": "bf16"},
        "elastic": {"min_replicas": 1, "max_replicas": 8},
        "train": {"global_batch_size": 32},
        "checkpoint": {"uri": "file:///tmp/fit"},
        "preemption": {"sources": [{"kind": "aws"}]},
    }
    return load_spec(raw, over)


def test_jit_fit_is_predicted_from_the_busiest_ranks_share() -> None:
    from spotline.planning.checkpoint_time import jit_fit_problem, save_bytes_per_rank
    from spotline.planning.memory_model import stage_params

    spec = _spec()
    biggest = max(stage_params(spec))
    # ZeRO-1: fp32 master + 2 moments split over D, plus the stage's bf16 weights once.
    assert save_bytes_per_rank(spec, 8) == pytest.approx(12 * biggest / 8 + 2 * biggest, abs=1)
    assert save_bytes_per_rank(spec, 1) == pytest.approx(4 * save_bytes_per_rank(spec, 8), rel=1e-6)
    # AWS gives 120 s: at 8 replicas the share goes up in time, at 1 it does not.
    assert jit_fit_problem(spec, 8) is None
    problem = jit_fit_problem(spec, 1)
    assert problem is not None
    assert "aws notice gives 120s less a 10s margin" in problem
    assert "busiest rank at 50 MB/s" in problem and "parallel.zero_stage" in problem
    # The shortest source decides; a source's own default_deadline_s counts.
    gcp = _spec(**{"preemption.sources": [{"kind": "aws"}, {"kind": "gcp"}]})
    assert "gcp notice gives 30s" in jit_fit_problem(gcp, 4)
    long_sigterm = _spec(**{"preemption.sources": [{"kind": "sigterm", "default_deadline_s": 600}]})
    assert jit_fit_problem(long_sigterm, 1) is None
    # No sources: no notice to meet.
    assert jit_fit_problem(_spec(**{"preemption.sources": []}), 1) is None


def test_jit_fit_from_measured_figures() -> None:
    from spotline.planning.checkpoint_time import jit_fit_problem

    spec = _spec()
    assert jit_fit_problem(spec, 1, save_s=40.0, step_s=2.0) is None
    problem = jit_fit_problem(spec, 1, save_s=105.0, step_s=6.0)
    assert problem is not None and "about 111s (measured, plus a 6.0s step)" in problem


def test_the_next_boundary_is_one_the_ranks_have_not_reached():
    """The ranks train ahead of the step the controller last saw (by up to two polls'
    worth): a boundary they passed would stop them at once, off the boundary."""
    assert next_boundary(655, 10, 0.0, 2000) == 660
    assert next_boundary(660, 10, 0.0, 2000) == 670
    ahead = 2 * constants.SPOTLINE_POLL_INTERVAL_S * 40  # 40 steps/s
    assert next_boundary(655, 10, 40.0, 2000) == ((655 + int(ahead)) // 10 + 1) * 10 > 660
    assert next_boundary(1995, 10, 40.0, 2000) == 2000  # never past the last step
