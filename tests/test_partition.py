"""The stage partitioner: exact against brute force, within memory, and its errors."""

from __future__ import annotations

import itertools
import random

import pytest

from spotline.config import load_spec
from spotline.config.loader import SpecError
from spotline.models import model_def
from spotline.planning.memory_model import StageMemoryModel, memory_per_device
from spotline.planning.partition import (
    NoPartitionFits,
    balanced_bounds,
    bounds_from_sizes,
    imbalance,
    stage_bounds,
    stage_times,
)

pytestmark = pytest.mark.unit


def all_bounds(n: int, p: int):
    for cuts in itertools.combinations(range(1, n), p - 1):
        yield [0, *cuts, n]


def brute_force(costs, speeds, fits=None) -> float | None:
    best = None
    n = len(costs[0]) if isinstance(costs[0], list) else len(costs)
    for b in all_bounds(n, len(speeds)):
        if fits is not None and not all(
            fits(s, lo, hi) for s, (lo, hi) in enumerate(itertools.pairwise(b))
        ):
            continue
        t = max(stage_times(costs, speeds, b))
        best = t if best is None else min(best, t)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_balanced_equals_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 9)
    p = rng.randint(1, min(n, 4))
    costs = [rng.choice([0.0, rng.uniform(0.1, 5.0)]) for _ in range(n)]
    if seed % 2:  # each stage measured the layers on its own kind of device
        costs = [[c * rng.uniform(0.3, 3.0) for c in costs] for _ in range(p)]
    speeds = [rng.uniform(0.5, 3.0) for _ in range(p)]
    b = balanced_bounds(costs, speeds)
    assert b[0] == 0 and b[-1] == n and all(hi > lo for lo, hi in itertools.pairwise(b))
    assert max(stage_times(costs, speeds, b)) == pytest.approx(brute_force(costs, speeds))


@pytest.mark.parametrize("seed", range(30))
def test_balanced_respects_memory_and_stays_optimal(seed):
    rng = random.Random(100 + seed)
    n = rng.randint(3, 9)
    p = rng.randint(2, min(n, 4))
    costs = [rng.uniform(0.1, 5.0) for _ in range(n)]
    speeds = [rng.uniform(0.5, 3.0) for _ in range(p)]
    mem = [rng.randint(1, 4) for _ in range(n)]
    cap = [rng.randint(3, 10) for _ in range(p)]

    def fits(s, lo, hi):
        return sum(mem[lo:hi]) <= cap[s]

    want = brute_force(costs, speeds, fits)
    if want is None:
        with pytest.raises(NoPartitionFits):
            balanced_bounds(costs, speeds, fits)
        return
    b = balanced_bounds(costs, speeds, fits)
    assert all(fits(s, lo, hi) for s, (lo, hi) in enumerate(itertools.pairwise(b)))
    assert max(stage_times(costs, speeds, b)) == pytest.approx(want)


def test_faster_stage_takes_more_layers():
    costs = [1.0] * 6
    assert balanced_bounds(costs, [1.0, 1.0]) == [0, 3, 6]
    assert balanced_bounds(costs, [1.0, 2.0]) == [0, 2, 6]
    assert balanced_bounds(costs, [2.0, 1.0]) == [0, 4, 6]
    # Per-stage costs: stage 1's device runs these layers twice as fast.
    assert balanced_bounds([[1.0] * 6, [0.5] * 6], [1.0, 1.0]) == [0, 2, 6]


def test_memory_limit_moves_layers_off_a_full_stage():
    costs = [1.0] * 6
    # Stage 1 is the fast one but holds at most 3 layers.
    b = balanced_bounds(costs, [1.0, 4.0], fits=lambda s, lo, hi: s == 0 or hi - lo <= 3)
    assert b == [0, 3, 6]


def test_no_partition_fits_is_an_error():
    with pytest.raises(NoPartitionFits):
        balanced_bounds([1.0] * 4, [1.0, 1.0], fits=lambda s, lo, hi: hi - lo <= 1)
    with pytest.raises(ValueError):
        balanced_bounds([1.0], [1.0, 1.0])  # a stage would be empty


def test_imbalance():
    assert imbalance([1.0, 1.0]) == 0.0
    assert imbalance([1.0, 3.0]) == pytest.approx(0.5)
    assert imbalance([2.0, 1.0, 1.0, 0.0]) == pytest.approx(1.0)
    assert bounds_from_sizes([3, 2, 4]) == [0, 3, 5, 9]


def spec(**parallel):
    return load_spec(
        {
            "name": "p",
            "model": {"n_layers": 4, "d_model": 32, "n_heads": 2, "seq_len": 32, "vocab_size": 512},
            "parallel": {"pipeline_stages": 2, **parallel},
        }
    )


def test_memory_model_of_any_bounds_matches_the_uniform_report():
    s = spec()
    mem = StageMemoryModel(s)
    uniform = stage_bounds(model_def(s), 2)
    assert memory_per_device(s) == [
        mem.stage(i, lo, hi) for i, (lo, hi) in enumerate(itertools.pairwise(uniform))
    ]
    # More blocks on a stage cost more state and activations; the head brings the logits.
    assert mem.stage(0, 0, 4).total_bytes > mem.stage(0, 0, 3).total_bytes
    assert mem.stage(1, 5, 6).activation_bytes == mem.logits


@pytest.mark.parametrize(
    ("parallel", "field"),
    [
        ({"partition": [3, 2]}, "parallel.partition"),
        ({"partition": [6]}, "parallel.partition"),
        ({"partition": "even"}, "parallel.partition"),
        ({"rebalance_threshold": 0}, "parallel.rebalance_threshold"),
        ({"rebalance_window_steps": 0}, "parallel.rebalance_window_steps"),
    ],
)
def test_bad_partition_fields_fail_naming_the_field(parallel, field):
    with pytest.raises(SpecError) as e:
        spec(**parallel)
    assert field in str(e.value) and "\n" not in str(e.value)


def test_resources_per_stage():
    s = load_spec(
        {
            "name": "p",
            "parallel": {"pipeline_stages": 2},
            "resources": {
                "cpus_per_worker": 1,
                "stages": [{}, {"cpus": 2, "accelerator_type": "H100"}],
            },
        }
    )
    assert s.resources.stage(0).cpus == 1 and s.resources.stage(1).cpus == 2
    with pytest.raises(SpecError, match="resources.stages"):
        load_spec({"name": "p", "parallel": {"pipeline_stages": 2}, "resources": {"stages": [{}]}})


# --- the re-partition rule ----------------------------------------------------------


def _decide(**over):
    from spotline.controller.repartition import RebalancePolicy

    args = {
        "window": [(s, 0.3) for s in range(5, 31, 5)],
        "stage_s": [4.0, 8.0],
        "bounds": [0, 4, 8],
        "layer_s": [1.0] * 8,
        "cut": lambda speeds: balanced_bounds([1.0] * 8, speeds),
        "steps_left": 1000,
        "steps_per_s": 10.0,
        "restart_s": 1.0,
        "running_s": 10.0,
    }
    args.update(over)
    return RebalancePolicy(threshold=0.1, window_steps=20).decide(**args)


def test_rebalance_rule():
    d = _decide()
    # Stage 1 measured at half stage 0's speed: of 8 layers at speeds (1, 0.5), the
    # slowest stage takes 6 (ties go to the earlier stage: 6 + 2, 6 s against 4 s).
    assert d is not None and d.bounds == [0, 6, 8]
    assert d.measured_imbalance == pytest.approx(1 / 3)
    assert d.speedup == pytest.approx(8.0 / 6.0)
    assert d.predicted_imbalance == pytest.approx(0.2)
    # Not over the threshold for the whole window; a window too short; nothing to move.
    assert _decide(window=[(5, 0.3), (15, 0.05), (30, 0.3)]) is None
    assert _decide(window=[(25, 0.3), (30, 0.3)]) is None
    assert _decide(stage_s=[4.0, 4.4], window=[(s, 0.05) for s in range(5, 31, 5)]) is None
    # The grow rule's cost test: the restart must pay over the remaining steps, after a dwell.
    assert _decide(steps_left=20) is None
    assert _decide(running_s=1.0) is None


@pytest.mark.parametrize("n_layers", [1, 2, 3, 5, 8, 12])
def test_uniform_bounds_are_deepspeeds_type_partition(n_layers):
    # Spotline always hands DeepSpeed explicit bounds; uniform must cut where DeepSpeed's
    # `type:<block>` partition cut before, so earlier jobs resume at the same stages.
    from deepspeed.runtime import utils as ds_utils

    for stages in range(1, min(n_layers, 4) + 1):
        s = load_spec(
            {
                "name": "p",
                "model": {"n_layers": n_layers, "d_model": 32, "n_heads": 2, "seq_len": 32},
                "parallel": {"pipeline_stages": stages},
            }
        )
        model = model_def(s)
        weights = [int(ld.cls is model.block_class) for ld in model.layers]
        assert stage_bounds(model, stages) == ds_utils.partition_balanced(weights, stages)
