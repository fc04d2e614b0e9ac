"""The `resources` section of a job spec: what each worker asks Ray for, and the shape
of the cluster's nodes that the plan's per-node figures assume."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class StageResourcesSpec(BaseModel):
    """What the workers of one pipeline stage ask Ray for, when the stages differ (a replica
    may mix device types: its first stage on one kind, its last on another)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    cpus: float | None = Field(None, ge=0.0)
    """CPUs per worker of this stage (default resources.cpus_per_worker); on CPU also the
    worker's torch thread budget."""
    accelerator_type: str | None = Field(None, min_length=1)
    """Ray accelerator type this stage's devices must be, e.g. 'A100' or 'H100' (the
    `accelerator_type:<name>` resource Ray gives nodes with such devices)."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources (node labels) each worker of this stage needs, e.g.
    {"fast_nvme": 0.01}."""
    device_memory_gb: float | None = Field(None, gt=0.0)
    """Memory of one device of this stage (default resources.device_memory_gb): the
    balanced partition keeps each stage within it."""


class ResourcesSpec(BaseModel):
    """What each worker (one per pipeline stage per replica) asks Ray for."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    device: Literal["auto", "gpu", "cpu"] = "auto"
    """'gpu' places one worker per GPU (nccl), 'cpu' uses logical CPU workers (gloo),
    'auto' decides at every group start: gpu when a node the group can use has GPUs
    (then only GPU nodes), otherwise cpu. A group never mixes the two, and 'gpu' never
    falls back to CPU: it waits for GPU nodes."""
    socket_ifname: str | None = Field(None, pattern=r"^[A-Za-z0-9_.:@-]+(,[A-Za-z0-9_.:@-]+)*$")
    """Network interface(s) the ranks talk over, e.g. 'eth0' or 'ens5,ens6': set as
    NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME in every worker. None: gloo binds to the
    interface of the node's Ray address, NCCL picks its own."""
    cpus_per_worker: float = Field(0.5, ge=0.0)
    """CPUs reserved per worker; on CPU this is also the worker's torch thread budget."""
    device_memory_gb: float | None = Field(None, gt=0.0)
    """Memory of one device, for the preflight's check that the model fits. None: the
    driver's own GPU when it has one, the host's RAM for CPU workers of a local cluster,
    otherwise unchecked."""
    ranks_per_node: int | None = Field(None, ge=1)
    """Ranks one node of the cluster holds (its devices), for the plan's per-node figures
    (peer memory). None: every rank on this machine for a local cluster, else 8."""
    node_memory_gb: float | None = Field(None, gt=0.0)
    """Host RAM of one node, for the plan's peer-memory budget (recovery.peer_memory as
    a share). None: this machine's RAM for a local cluster, else unknown. A running job
    reads each node's own from Ray."""
    stages: list[StageResourcesSpec] = Field(default_factory=list)
    """Per pipeline stage, what differs from the fields above (one entry per stage, or
    none): e.g. [{cpus: 1}, {cpus: 2}], or [{accelerator_type: A100},
    {accelerator_type: H100}]."""

    def stage(self, stage: int) -> StageResourcesSpec:
        """The resources of `stage`'s workers, the defaults filled in."""
        own = self.stages[stage] if self.stages else StageResourcesSpec()
        return own.model_copy(
            update={
                "cpus": self.cpus_per_worker if own.cpus is None else own.cpus,
                "device_memory_gb": own.device_memory_gb or self.device_memory_gb,
            }
        )
