"""Which contiguous layers each pipeline stage holds: uniform, explicit, or balanced.

The one place that cuts the layer list. Pure arithmetic (no torch, no Ray). A
partition is given as layer-index bounds, as DeepSpeed's `PipelineModule` takes them:
stage s holds layers `bounds[s]:bounds[s+1]`; `models.build_pipeline_module` builds
whatever bounds its caller passes and never cuts by itself.

The uniform partition (`stage_bounds`) is DeepSpeed's `type:` cut: the blocks split as
evenly as possible. An explicit one comes from layer counts (`bounds_from_sizes`).

The balanced partition minimises the slowest stage: with `costs[s][l]` the measured
seconds of layer l on a device of stage s (forward + backward of one micro-batch) and
`speeds[s]` how fast the stage's slowest device is against the one that measured
them, stage s takes `sum(costs[s][a:b]) / speeds[s]`; a 1F1B step lasts about
(m + p - 1) x the slowest stage. One cost list for every stage is the same as a row
per stage (devices of one kind, speeds from a matmul). An exact dynamic programme over
prefix sums finds the split whose slowest stage is fastest, among the splits whose
every stage fits its device's memory (`fits`). Which of these a job runs at is chosen
in `spotline.planning.choice`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spotline.models import ModelDef

Fits = Callable[[int, int, int], bool]
"""fits(stage, lo, hi): whether layers lo:hi fit the memory of stage `stage`'s devices."""


class NoPartitionFits(ValueError):
    """No contiguous split of the layers over the stages fits every device's memory."""


def stage_bounds(model: ModelDef, num_stages: int) -> list[int]:
    """Layer index boundaries of each stage as DeepSpeed's `type:` partition cuts them:
    blocks split as evenly as possible, earlier stages taking the remainder, the layers
    before the first block on the first stage and those after the last on the last."""
    block_idx = [i for i, ld in enumerate(model.layers) if ld.cls is model.block_class]
    n = len(block_idx)
    base, extra = divmod(n, num_stages)
    bounds = [0]
    taken = 0
    for s in range(num_stages - 1):
        taken += base + (1 if s < extra else 0)
        bounds.append(block_idx[taken] if taken < n else len(model.layers))
    bounds.append(len(model.layers))
    return bounds


def bounds_from_sizes(sizes: Sequence[int]) -> list[int]:
    """[3, 2, 4] layers per stage -> bounds [0, 3, 5, 9]."""
    return [0, *itertools.accumulate(sizes)]


def sizes_from_bounds(bounds: Sequence[int]) -> list[int]:
    return [b - a for a, b in itertools.pairwise(bounds)]


Costs = Sequence[float] | Sequence[Sequence[float]]
"""Seconds per layer: one list for every stage, or one list per stage."""


def cost_rows(costs: Costs, stages: int) -> list[list[float]]:
    """One cost list per stage."""
    if costs and isinstance(costs[0], (list, tuple)):
        if len(costs) != stages:
            raise ValueError(f"{len(costs)} cost rows for {stages} stages")
        return [[float(c) for c in row] for row in costs]  # type: ignore[union-attr]
    return [[float(c) for c in costs]] * stages  # type: ignore[arg-type]


def stage_times(costs: Costs, speeds: Sequence[float], bounds: Sequence[int]) -> list[float]:
    """Predicted seconds of each stage under `bounds`."""
    rows = cost_rows(costs, len(speeds))
    return [sum(rows[s][a:b]) / speeds[s] for s, (a, b) in enumerate(itertools.pairwise(bounds))]


def imbalance(times: Sequence[float]) -> float:
    """How much longer the slowest stage runs than the mean: max / mean - 1.

    0 is perfect balance; 0.25 means the step runs about 25% longer than it would if the
    same work were spread evenly (the slowest stage sets the pace of a 1F1B step).
    """
    if not times:
        return 0.0
    mean = sum(times) / len(times)
    return max(times) / mean - 1.0 if mean > 0 else 0.0


def balanced_bounds(costs: Costs, speeds: Sequence[float], fits: Fits | None = None) -> list[int]:
    """The contiguous split of the layers over len(speeds) stages, one layer at least
    each, whose slowest stage is fastest, among those where every stage fits.

    Ties go to the split that puts more layers on earlier stages, so equal inputs give
    the same bounds every time. NoPartitionFits when no split fits.
    """
    p = len(speeds)
    rows = cost_rows(costs, p) if p else []
    n = len(rows[0]) if rows else len(costs)
    if p < 1 or n < p or any(len(r) != n for r in rows):
        raise ValueError(f"cannot split {n} layer(s) over {p} stage(s): each needs one")
    if any(c < 0 for r in rows for c in r) or any(s <= 0 for s in speeds):
        raise ValueError("layer costs must be >= 0 and stage speeds > 0")
    prefixes = [[0.0, *itertools.accumulate(r)] for r in rows]
    inf = float("inf")
    # best[s][j]: the slowest stage of the best split of layers 0:j over stages 0..s-1;
    # cut[s][j]: where stage s-1 starts in it.
    best = [[inf] * (n + 1) for _ in range(p + 1)]
    cut = [[-1] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for s in range(1, p + 1):
        speed, prefix = speeds[s - 1], prefixes[s - 1]
        # Stage s-1 ends at j; the p - s later stages still need a layer each.
        for j in range(s, n - (p - s) + 1):
            for i in range(j - 1, s - 2, -1):  # latest start first: ties favour earlier stages
                if best[s - 1][i] == inf:
                    continue
                t = max(best[s - 1][i], (prefix[j] - prefix[i]) / speed)
                if t < best[s][j] and (fits is None or fits(s - 1, i, j)):
                    best[s][j], cut[s][j] = t, i
    if best[p][n] == inf:
        raise NoPartitionFits(f"no split of {n} layers over {p} stages fits every stage's memory")
    bounds = [n]
    for s in range(p, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    return bounds[::-1]


def check_bounds(bounds: Sequence[int], n_layers: int, stages: int) -> str | None:
    """Why `bounds` is not a partition of n_layers over `stages` (None when it is)."""
    b = list(bounds)
    if len(b) != stages + 1 or b[0] != 0 or b[-1] != n_layers:
        return f"needs {stages + 1} bounds from 0 to {n_layers}, got {b}"
    if any(hi <= lo for lo, hi in itertools.pairwise(b)):
        return f"every stage needs at least one layer, got bounds {b}"
    return None
