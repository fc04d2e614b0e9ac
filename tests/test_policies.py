"""Failure and scaling policies: plain decisions from plain inputs, no Ray."""

from __future__ import annotations

import pytest

from spotline.controller.policies import (
    Fail,
    FailurePolicy,
    GrowPolicy,
    Resize,
    Restart,
    ScalingPolicy,
    Wait,
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
        since_resize_s=1e6,
    )
    args.update(kw)
    return GrowPolicy(ScalingPolicy(1, 4), interval_s=120.0).decide(**args)


def test_grow_when_the_time_saved_beats_twice_the_restart_cost() -> None:
    # 1000 s left at 1 replica; at 2 it saves 500 s > 2 x 60 s.
    assert _grow() == Resize(2)
    assert _grow(capacity=9) == Resize(4)  # never above max_replicas


def test_no_grow_when_the_restart_costs_more_than_it_saves() -> None:
    # 200 s left; 2 replicas save 100 s, less than 2 x 60 s.
    assert _grow(steps_left=200) is None
    assert _grow(steps_left=250) == Resize(2)  # 125 s saved > 120 s


def test_no_grow_inside_the_cadence_or_without_more_capacity() -> None:
    assert _grow(since_resize_s=60.0) is None
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
    grow = GrowPolicy(sizes, interval_s=0.0)
    args = dict(steps_left=1000, steps_per_s=1.0, restart_s=1.0, since_resize_s=1.0)
    assert grow.decide(replicas=2, capacity=3, **args) is None  # 3 is not allowed
    assert grow.decide(replicas=2, capacity=5, **args) == Resize(4)
