"""Where a job's workers go: what one worker asks Ray for, and which live nodes take
new work (not draining after a preemption notice, not cordoned).

One reader of Ray's draining set serves the worker groups, the capacity view and the
autoscaler demand. It reads Ray's state and never places or kills anything.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from spotline.config.schema import JobSpec

if TYPE_CHECKING:  # the worker's module loads torch
    from spotline.train.process import Topology

log = logging.getLogger("spotline.placement")


def worker_name(topo: Topology) -> str:
    """The dashboard name of a rank: where it sits in the job, not its number."""
    return f"stage-{topo.stage}/replica-{topo.replica}"


def draining_nodes() -> set[str]:
    """The ids of the nodes Ray is draining (a preemption notice); none when Ray cannot
    say, with a warning: the nodes are then counted as they look."""
    from spotline.compat import ray as ray_internals

    try:
        return set(ray_internals.draining_nodes(timeout_s=5))
    except Exception as e:  # noqa: BLE001 - drains unknown: none is assumed
        log.warning("could not ask Ray which nodes are draining: %s", e)
        return set()


def usable_nodes() -> list[dict[str, float]]:
    """The total resources of each live node that takes new work (not draining): the
    nodes a group about to start can be placed on."""
    import ray

    draining = draining_nodes()
    return [dict(n["Resources"]) for n in ray.nodes() if n["Alive"] and n["NodeID"] not in draining]


def held_out_nodes(cordoned: set[str] = frozenset()) -> list[dict[str, float]]:
    """The total resources of each live node the job will not place on: draining (a
    preemption notice: still up, but about to go) or `cordoned`."""
    import ray

    out = draining_nodes() | set(cordoned)
    return [dict(n["Resources"]) for n in ray.nodes() if n["Alive"] and n["NodeID"] in out]


def worker_bundle(spec: JobSpec, device: str, stage: int = 0) -> dict[str, float]:
    """What one worker of `stage` asks Ray for: CPUs, a GPU, an accelerator type (Ray's
    `accelerator_type:<name>` node resource) and custom resources (node labels)."""
    r = spec.resources.stage(stage)
    bundle = {"CPU": r.cpus}
    if device == "gpu":
        bundle["GPU"] = 1.0
    if r.accelerator_type:
        bundle[f"accelerator_type:{r.accelerator_type}"] = 0.001
    bundle.update(r.resources)
    return {k: v for k, v in bundle.items() if v > 0}


def bundle_kinds(bundles: list[dict[str, float]]) -> str:
    """The distinct bundles of `bundles`, for a message: "{'CPU': 1.0} / {...}"."""
    kinds: list[dict[str, float]] = []
    for b in bundles:
        if b not in kinds:
            kinds.append(b)
    return " / ".join(str(b) for b in kinds)
