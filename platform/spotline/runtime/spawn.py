"""Starting one rank's actor in its bundle: the one way a worker process comes to be,
for a group's new replicas (`group.py`) and for replicas started ahead (`standby.py`)."""

from __future__ import annotations

from typing import Any

from spotline.config.schema import JobSpec
from spotline.runtime.placement import worker_name
from spotline.runtime.sealed import SealedJob
from spotline.train.process import Topology


def start_worker(
    spec: JobSpec,
    job: SealedJob,
    topo: Topology,
    attempt: str,
    where: Any,
    bundle: dict[str, float],
    gpu_fraction: float = 0.0,
    name: str | None = None,
) -> Any:
    """A `TrainWorker` actor for rank `topo` of group `attempt`, scheduled by `where` (its
    placement group's bundle). With a sidecar in the bundle the worker leaves
    `gpu_fraction` of its GPU to it: both share the bundle, so Ray gives them the same
    physical device. `name`: its dashboard name (default: its place in the job)."""
    import ray

    from spotline.runtime.actor import TrainWorker

    cls = ray.remote(concurrency_groups={"control": 1})(TrainWorker)
    return cls.options(
        num_cpus=bundle.get("CPU", 0),
        num_gpus=bundle.get("GPU", 0) * (1 - gpu_fraction),
        resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
        name=name or f"spotline:{spec.name}:{worker_name(topo)}:{attempt}",
        scheduling_strategy=where,
        max_restarts=0,
    ).remote(job, topo, attempt)
