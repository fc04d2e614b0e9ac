"""The controller as a Ray actor on the head node, named for the dashboard.

`max_concurrency` lets `status()` answer while `run()` drives the job on
another thread of the same actor.
"""

from __future__ import annotations

from typing import Any

from spotline.checkpoint import CheckpointStore
from spotline.config.schema import JobSpec
from spotline.controller.clock import Clock
from spotline.controller.controller import Controller
from spotline.runtime.sealed import SealedJob

CONTROLLER_NAMESPACE = "spotline"
"""The Ray namespace every job's controller is named in, whatever the driver's own: a
driver that names none gets an anonymous namespace of its own, where no other process
(`spotline status NAME`, a second driver of the same job) could find the controller."""


def controller_name(job: str) -> str:
    return f"spotline:{job}:controller"


def find_controller(job: str) -> Any | None:
    """The running controller of `job` on the connected cluster, or None."""
    import ray

    try:
        return ray.get_actor(controller_name(job), namespace=CONTROLLER_NAMESPACE)
    except ValueError:
        return None


def running_jobs() -> list[str]:
    """The names of the jobs whose controller runs on the connected cluster."""
    import ray

    head, tail = "spotline:", ":controller"  # as controller_name writes them
    return sorted(
        a["name"][len(head) : -len(tail)]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a.get("namespace") == CONTROLLER_NAMESPACE
        and a["name"].startswith(head)
        and a["name"].endswith(tail)
    )


class ControllerActor:
    def __init__(self, job: SealedJob):
        import logging

        import ray

        from spotline.config.redact import install_log_redaction
        from spotline.runtime.cluster import RayClusterView
        from spotline.runtime.demand import RayDemand
        from spotline.runtime.group import RayWorkerGroup
        from spotline.runtime.peers import PeerMemory
        from spotline.runtime.stacks import RayStacks
        from spotline.runtime.standby import Standby

        # Events also go to this actor's log, which the Ray dashboard shows: redacted.
        install_log_redaction()
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
        spec, store = job.open()
        # 'auto' stays 'auto' here: each group decides from the nodes there are when it
        # starts, not from the cluster the controller happened to start on.
        device = spec.resources.device
        pool = sidecar = None
        if spec.backfill.enabled:
            # The executors ride along each worker as a sidecar; the runtime never
            # imports backfill.
            from spotline.backfill.executor import sidecar_factory
            from spotline.backfill.pool import BackfillPool

            pool = BackfillPool(spec)
            sidecar = sidecar_factory(spec, store)
        cluster = RayClusterView(spec, device, ray.get_runtime_context().current_actor)
        clock = Clock()  # the one clock: the loop's, its starts' and its replicas started ahead
        # The state keepers outlive every group; they go when the job ends.
        self.peers = PeerMemory(spec) if spec.recovery.peer_snapshots else None
        self.controller = Controller(
            spec,
            store,
            group_factory=lambda replicas: RayWorkerGroup(
                spec,
                replicas,
                store,
                device,
                sidecar=sidecar,
                sidecar_gpu_fraction=spec.backfill.gpu_fraction,
                avoid=cluster.cordoned,
                peers=self.peers,
                clock=clock.monotonic,
            ),
            cluster=cluster,
            backfill=pool,
            demand=RayDemand(spec, device, cordoned=cluster.cordoned),
            peers=self.peers,
            standby=Standby(
                spec, store, spec.backfill.gpu_fraction if sidecar else 0.0, clock.monotonic
            ),
            clock=clock,
            stacks=RayStacks(),
        )
        # On this cluster, a lease on the checkpoint root is a live job's only while that
        # job's controller runs: a rerun after a killed driver need not wait it out.
        lease = self.controller.coordinator.lease
        lease.cluster = ray.get_runtime_context().gcs_address
        lease.alive = lambda job: find_controller(job) is not None

    def run(self) -> dict[str, Any]:
        try:
            return self.controller.run()
        finally:
            if self.peers is not None:
                self.peers.close()

    # What other threads ask: the door reads only what the loop published.

    def notify(self, notice: dict[str, Any]) -> bool:
        """A preemption notice from a node watcher; True once accepted."""
        return self.controller.door.notify(notice)

    def stop(self, reason: str = "stop requested") -> None:
        self.controller.door.request_stop(reason)

    def hold_latest(self, seconds: float = 900.0) -> dict[str, Any] | None:
        return self.controller.door.hold_latest(seconds)

    def repartition(self, sizes: list[int]) -> None:
        self.controller.door.request_repartition(sizes)

    def status(self, since_event: int = 0) -> dict[str, Any]:
        return self.controller.door.status(since_event)

    def result(self) -> dict[str, Any]:
        return self.controller.door.result()

    def submit_backfill(self, task: Any, name: str | None = None) -> int:
        return self.controller.backfill_api.submit(task, name)

    def backfill_record(self, task_id: int) -> dict[str, Any] | None:
        return self.controller.backfill_api.record(task_id)

    def trace(self) -> dict[str, Any] | None:
        return self.controller.door.trace()

    def summary(self) -> dict[str, Any]:
        return self.controller.door.summary()

    def stacks(self) -> dict[str, Any]:
        """Every rank's stack now (`spotline stacks`)."""
        return self.controller.door.take_stacks()


def uploaded_runtime_env(spec: JobSpec) -> dict | None:
    """runtime_env with its local directories uploaded to the cluster (as `ray.init`
    does for a job's own runtime_env), so that it also works for a job started on a
    cluster this driver attached to earlier: Ray takes local paths only at ray.init."""
    env = spec.runtime_env.ray()
    if env is None:
        return None
    from spotline.compat.ray import upload_py_modules_if_needed, upload_working_dir_if_needed

    env = upload_py_modules_if_needed(env, include_gitignore=True)
    env = upload_working_dir_if_needed(env, include_gitignore=True)
    env.pop("excludes", None)
    return env


def start_controller(spec: JobSpec, store: CheckpointStore):
    """Create the named controller actor, pinned to the head node (the driver's node)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    name = controller_name(spec.name)
    if find_controller(spec.name) is not None:
        raise RuntimeError(
            f"a Spotline job named {spec.name!r} is already running on this cluster (actor {name}); "
            "wait for it, stop it (ray job stop / Ctrl-C its driver), or give this job another name"
        )
    head = ray.get_runtime_context().get_node_id()
    cls = ray.remote(ControllerActor)
    return cls.options(
        name=name,
        namespace=CONTROLLER_NAMESPACE,
        num_cpus=0,
        max_concurrency=4,
        max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=head, soft=False),
        # User code (a custom model) the job imports; the workers and executors the
        # controller starts inherit it.
        runtime_env=uploaded_runtime_env(spec),
    ).remote(SealedJob(spec, store))
