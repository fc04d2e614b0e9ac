"""A group of worker actors that train as one DeepSpeed job.

The controller only talks to this interface (`WorkerGroup`), so controller
tests swap in a fake group. `RayWorkerGroup` places one actor per device with a
placement group: the stages of a replica are consecutive bundles, packed onto a
node where they fit. Rank = stage * replicas + replica, as DeepSpeed's grid expects.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Protocol

from spotline import constants
from spotline.checkpoint import CheckpointStore, CorruptCheckpointError, Manifest
from spotline.config.redact import redact
from spotline.config.schema import JobSpec
from spotline.workers.trainer import Topology

PROCESS_DIED = "worker process died (killed, out of memory, or its node was lost)"


class WorkerFailure(RuntimeError):
    """One or more ranks failed. `ranks_by_error` groups identical errors across ranks."""

    def __init__(
        self,
        what: str,
        ranks_by_error: dict[str, list[int]],
        nodes: dict[int, str] | None = None,
        causes: list[BaseException] | None = None,
    ):
        self.what = what
        self.ranks_by_error = ranks_by_error
        self.nodes = nodes or {}
        self.causes = causes or []
        super().__init__(self._render())

    @property
    def process_died(self) -> bool:
        """Some rank's process is gone (not merely raised): its node may be lost."""
        return PROCESS_DIED in self.ranks_by_error

    def _render(self) -> str:
        parts = []
        for err, ranks in self.ranks_by_error.items():
            where = ", ".join(
                f"{r}" + (f"@{self.nodes[r][:8]}" if r in self.nodes else "") for r in sorted(ranks)
            )
            parts.append(f"[ranks {where}]: {err}")
        return redact(f"{self.what} failed: " + "; ".join(parts))


@dataclass
class ChunkResult:
    losses: list[tuple[int, float]]
    seconds: float
    uploads: list[Any] = field(default_factory=list)
    interrupted: bool = False
    """The ranks stopped early at a step boundary because one of them was asked to."""
    notices: list[dict[str, Any]] = field(default_factory=list)
    """Preemption notices the ranks saw themselves (SIGTERM), as Notice fields + rank."""
    bubbles: list[dict[str, Any]] = field(default_factory=list)
    """Per rank of a pipeline: bubble figures of the chunk and its latest step's timeline."""
    lr: float | None = None
    """Learning rate of the chunk's last step."""
    data_stall_s: float = 0.0
    """Seconds the chunk's steps waited for their batches (the slowest rank's)."""


class WorkerGroup(Protocol):
    """What the controller needs from a group of ranks."""

    world_size: int
    replicas: int

    def start(self) -> None: ...
    def restore(self, manifest: Manifest) -> int: ...
    def train(self, n_steps: int) -> ChunkResult: ...
    def request_checkpoint(self, reason: str) -> None: ...
    def node_ids(self) -> set[str]: ...
    def save(self) -> float: ...
    def flush_uploads(self) -> list[Any]: ...
    def heldout_loss(self) -> float: ...
    def executors(self) -> list[Any]: ...
    def peak_flops(self) -> float | None: ...
    def worker_info(self) -> list[dict[str, Any]]: ...
    def shutdown(self) -> None: ...


def worker_name(topo: Topology) -> str:
    """The dashboard name of a rank: where it sits in the job, not its number."""
    return f"stage-{topo.stage}/replica-{topo.replica}"


def resolve_device(spec: JobSpec) -> str:
    import ray

    if spec.resources.device != "auto":
        return spec.resources.device
    return "gpu" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"


def worker_bundle(spec: JobSpec, device: str) -> dict[str, float]:
    bundle = {"CPU": spec.resources.cpus_per_worker}
    if device == "gpu":
        bundle["GPU"] = 1.0
    return {k: v for k, v in bundle.items() if v > 0}


class RayWorkerGroup:
    def __init__(self, spec: JobSpec, replicas: int, store: CheckpointStore, device: str):
        self.spec = spec
        self.replicas = replicas
        self.store = store
        self.device = device
        self.pp = spec.parallel.pipeline_stages
        self.world_size = self.pp * replicas
        self.run_id = uuid.uuid4().hex[:8]
        self.pg = None
        self.actors: list[Any] = []
        self.backfill: list[Any] = []  # one executor per rank when backfill is on
        self._info: list[dict[str, Any]] = []
        self._devices: list[dict[str, Any]] = []  # per rank: device name and peak FLOP/s

    # --- helpers ------------------------------------------------------------------

    def _call_all(
        self, what: str, method: str, *args: Any, per_rank_args=None, timeout_s=None
    ) -> list[Any]:
        """Call `method` on every rank and wait; any dead or raising rank -> WorkerFailure.

        Waits with ray.wait rather than ray.get: when one rank dies, its peers block in
        a collective, and the dead rank must be seen without waiting on the others.
        """
        import ray

        futures = []
        for rank, actor in enumerate(self.actors):
            a = per_rank_args[rank] if per_rank_args else args
            futures.append(getattr(actor, method).remote(*a))
        rank_of = {f: r for r, f in enumerate(futures)}
        results: dict[int, Any] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = list(futures)
        while pending:
            ready, pending = ray.wait(
                pending, num_returns=1, timeout=constants.SPOTLINE_POLL_INTERVAL_S
            )
            for f in ready:
                try:
                    results[rank_of[f]] = ray.get(f)
                except Exception as e:  # noqa: BLE001 - grouped and re-raised below
                    self._raise_failure(what, rank_of[f], e, futures, rank_of)
            if deadline is not None and time.monotonic() > deadline and pending:
                late = sorted(rank_of[f] for f in pending)
                raise WorkerFailure(
                    what, {f"no answer within {timeout_s:.0f}s": late}, self._nodes()
                )
        return [results[r] for r in range(len(futures))]

    def _raise_failure(self, what, first_rank, first_exc, futures, rank_of) -> None:
        import ray

        # Give peers a moment to fail too, so the report shows every affected rank.
        errors: dict[str, list[int]] = defaultdict(list)
        errors[_describe(first_exc)].append(first_rank)
        causes = [_cause(first_exc)]
        others = [f for f in futures if rank_of[f] != first_rank]
        ready, _ = ray.wait(others, num_returns=len(others), timeout=1.0)
        for f in ready:
            try:
                ray.get(f)
            except Exception as e:  # noqa: BLE001
                errors[_describe(e)].append(rank_of[f])
                causes.append(_cause(e))
        raise WorkerFailure(what, dict(errors), self._nodes(), causes)

    def _nodes(self) -> dict[int, str]:
        return {i["rank"]: i["node_id"] for i in self._info}

    # --- WorkerGroup --------------------------------------------------------------

    def start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from spotline.workers.actor import TrainWorker

        bundle = worker_bundle(self.spec, self.device)
        # Bundle i = (replica i // pp, stage i % pp): a replica's stages stay adjacent.
        self.pg = placement_group(
            [dict(bundle) for _ in range(self.world_size)],
            strategy="PACK",
            name=f"spotline:{self.spec.name}:{self.run_id}",
        )
        timeout = constants.SPOTLINE_WORKER_START_TIMEOUT_S
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout)
        if not ready:
            raise WorkerFailure(
                "placement",
                {
                    f"{self.world_size} workers of {bundle} could not be placed within {timeout:.0f}s "
                    f"(cluster has {ray.available_resources()} free); add nodes or lower "
                    "elastic.min_replicas / resources.cpus_per_worker": list(range(self.world_size))
                },
            )
        spec_json = self.spec.model_dump_json()
        cls = ray.remote(concurrency_groups={"control": 1})(TrainWorker)
        bf = self.spec.backfill
        # With backfill the worker leaves a fraction of its GPU to its executor; both are
        # in the same bundle, so Ray gives them the same physical device.
        gpus = bundle.get("GPU", 0) * ((1 - bf.gpu_fraction) if bf.enabled else 1)
        for rank in range(self.world_size):
            topo = Topology(self.pp, self.replicas, rank)
            idx = topo.replica * self.pp + topo.stage
            where = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=idx)
            self.actors.append(
                cls.options(
                    num_cpus=bundle.get("CPU", 0),
                    num_gpus=gpus,
                    name=f"spotline:{self.spec.name}:{worker_name(topo)}:{self.run_id}",
                    scheduling_strategy=where,
                    max_restarts=0,
                ).remote(spec_json, topo, self.store, self.run_id)
            )
            if bf.enabled:
                self.backfill.append(self._start_executor(topo, where, bundle, spec_json))
        self._info = self._call_all("start", "info", timeout_s=timeout)
        # Rank 0 hosts the torch.distributed store: its node and a port free there.
        addr = self._info[0]["ip"]
        port = ray.get(self.actors[0].free_port.remote(), timeout=timeout)
        self._devices = self._call_all("rendezvous", "setup", addr, port, timeout_s=timeout)

    def restore(self, manifest: Manifest) -> int:
        """Two phases: every rank downloads and verifies, and only then does any rank load.

        A corrupt file found by any rank raises CorruptCheckpointError before a single
        rank has loaded, so the controller can fall back to an older step. A file that
        verifies but does not parse (not safetensors/JSON) is corrupt too.
        """
        dirs = self._corrupt_or_failure(
            lambda: self._call_all(
                f"download of checkpoint step {manifest.step}",
                "fetch_checkpoint",
                manifest.to_json(),
            )
        )
        steps = self._corrupt_or_failure(
            lambda: self._call_all(
                f"load of checkpoint step {manifest.step}",
                "load_checkpoint",
                per_rank_args=[(d, manifest.step) for d in dirs],
            )
        )
        return steps[0]

    @staticmethod
    def _corrupt_or_failure(call):
        try:
            return call()
        except WorkerFailure as e:
            corrupt = [c for c in e.causes if isinstance(c, CorruptCheckpointError)]
            if corrupt:
                raise corrupt[0] from e
            raise

    def train(self, n_steps: int) -> ChunkResult:
        results = self._call_all("training", "train", n_steps)
        return ChunkResult(
            losses=results[0]["losses"],
            seconds=max(r["seconds"] for r in results),
            uploads=[u for r in results for u in r["uploads"]],
            interrupted=results[0]["interrupted"],
            notices=[n for r in results for n in r["notices"]],
            bubbles=[r["bubbles"] for r in results if r.get("bubbles")],
            lr=results[0].get("lr"),
            data_stall_s=max(r.get("data_stall_s", 0.0) for r in results),
        )

    def _start_executor(self, topo: Topology, where: Any, bundle: dict, spec_json: str) -> Any:
        import ray

        from spotline.backfill.executor import BackfillExecutor
        from spotline.workers.actor import channel_path

        cls = ray.remote(concurrency_groups={"control": 1})(BackfillExecutor)
        gpu = bundle.get("GPU", 0) * self.spec.backfill.gpu_fraction
        return cls.options(
            num_cpus=0,  # shares the worker's CPUs: it only runs while the worker waits
            num_gpus=gpu,
            name=f"spotline:{self.spec.name}:backfill:{worker_name(topo)}:{self.run_id}",
            scheduling_strategy=where,
            max_restarts=-1,  # a crashed task's executor comes back for the next task
        ).remote(
            spec_json,
            topo.rank,
            topo.stage,
            channel_path(self.spec, self.run_id, topo.rank),
            self.store,
            max(1, int(self.spec.resources.cpus_per_worker)),
            topo.rank if constants.SPOTLINE_PIN_CORES else None,
        )

    def executors(self) -> list[Any]:
        return list(self.backfill)

    def peak_flops(self) -> float | None:
        """Peak FLOP/s of one device of this group (the slowest), None if unknown."""
        peaks = [d.get("peak_flops") for d in self._devices]
        return min(peaks) if peaks and None not in peaks else None

    def request_checkpoint(self, reason: str) -> None:
        """Ask every rank to stop at the next step boundary; does not wait."""
        for a in self.actors:
            a.request_checkpoint.remote(reason)

    def node_ids(self) -> set[str]:
        return {i["node_id"] for i in self._info}

    def save(self) -> float:
        results = self._call_all("checkpoint save", "save")
        return max(r["blocked_s"] for r in results)

    def flush_uploads(self) -> list[Any]:
        return [u for r in self._call_all("checkpoint upload", "flush_uploads") for u in r]

    def heldout_loss(self) -> float:
        return self._call_all("held-out evaluation", "heldout_loss")[0]

    def worker_info(self) -> list[dict[str, Any]]:
        return list(self._info)

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        # Already-dead actors and groups are fine: teardown is idempotent.
        for a in self.backfill + self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        self.actors = []
        self.backfill = []
        if self.pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
            self.pg = None


def _cause(e: BaseException) -> BaseException:
    return getattr(e, "cause", None) or e


def _describe(e: BaseException) -> str:
    name = type(e).__name__
    if "ActorDied" in name or "ActorUnavailable" in name or "RayActorError" in name:
        return PROCESS_DIED
    cause = getattr(e, "cause", None)
    if cause is not None:
        return f"{type(cause).__name__}: {str(cause).strip().splitlines()[-1] if str(cause).strip() else ''}"
    text = str(e).strip().splitlines()
    return f"{name}: {text[-1] if text else ''}"
