"""Starting a replica's ranks: the one way worker processes come to be.

A replica is a placement group (its stages are the bundles, packed onto one node
where they fit) and one `TrainWorker` actor per stage. `ReplicaStart` takes it through
its phases, never waiting on any of them:

  placing -> starting -> started -> binding -> [rehearsing ->] ready

placing: Ray places the placement group; starting: the actors are created and say
where they run (`info`); started: the owner computes the device environment of every
rank on each node (`share_node_devices` over all the ranks it starts together) and
hands it to `bind`; binding: each rank sets it and imports DeepSpeed; rehearsing (a
replica started ahead only): its ranks build an engine among themselves (empty
weights, no step), paying a process's first-time costs before a group needs it.
`advance()` moves each phase on once its calls returned and raises `StartFailed`,
naming the phase, when one failed or outran SPOTLINE_WORKER_START_TIMEOUT_S.

Its owners poll it from their own loops: a group starting (`group.py`, which then
re-forms kept ranks and holds the rendezvous of all of them) and the replicas started
ahead (`standby.py`). `Calls` is the one way a set of rank calls is waited on (at
once, or polled), with failures grouped across ranks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from spotline import constants
from spotline.config.schema import JobSpec
from spotline.runtime.placement import bundle_kinds, worker_bundle, worker_name
from spotline.runtime.progress import WorkerFailure, collect, describe_failure, peer_failures
from spotline.runtime.rendezvous import check_one_device, rendezvous_url, share_node_devices
from spotline.runtime.sealed import SealedJob
from spotline.runtime.survivors import end
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

    cls = ray.remote(concurrency_groups={"control": 1, "abort": 1})(TrainWorker)
    return cls.options(
        num_cpus=bundle.get("CPU", 0),
        num_gpus=bundle.get("GPU", 0) * (1 - gpu_fraction),
        resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
        name=name or f"spotline:{spec.name}:{worker_name(topo)}:{attempt}",
        scheduling_strategy=where,
        max_restarts=0,
    ).remote(job, topo, attempt)


log = logging.getLogger("spotline.group")


class StartFailed(RuntimeError):
    """A replica's start failed or timed out; the message names the phase."""


class Calls:
    """One call per rank in flight (`refs` by rank), for `what`: polled (`poll`) or
    waited on (`wait`). A rank that raised or died raises WorkerFailure with every peer
    that failed with it; one not done by `deadline` (a clock reading) too."""

    def __init__(
        self,
        what: str,
        refs: dict[int, Any],
        nodes: dict[int, str],
        timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.what, self.refs, self.nodes, self.clock = what, dict(refs), nodes, clock
        self.deadline = None if timeout_s is None else clock() + timeout_s
        self.timeout_s = timeout_s
        self.results: dict[int, Any] = {}
        self._rank_of = {ref: r for r, ref in self.refs.items()}

    @classmethod
    def send(
        cls,
        what: str,
        actors: Sequence[Any],
        method: str,
        args: dict[int, tuple],
        nodes: dict[int, str],
        timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> Calls:
        """Call `method` on `actors[rank]` with `args[rank]` for each rank in `args`."""
        refs = {r: getattr(actors[r], method).remote(*a) for r, a in args.items()}
        return cls(what, refs, nodes, timeout_s, clock)

    def poll(self, timeout_s: float = 0.0) -> bool:
        """Take in what returned (waiting at most `timeout_s` for the first); True once
        every rank's call did."""
        import ray

        pending = [ref for ref, r in self._rank_of.items() if r not in self.results]
        if pending:
            ready, _ = ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
            for ref, (value, e) in zip(ready, collect(ready), strict=True):
                if e is not None:
                    errors, causes, silent = peer_failures(
                        self._rank_of[ref], e, list(self.refs.values()), self._rank_of
                    )
                    raise WorkerFailure(self.what, errors, self.nodes, causes, silent) from None
                self.results[self._rank_of[ref]] = value
        done = len(self.results) == len(self.refs)
        if not done and self.deadline is not None and self.clock() > self.deadline:
            late = sorted(r for r in self.refs if r not in self.results)
            raise WorkerFailure(
                self.what, {f"no answer within {self.timeout_s:.0f}s": late}, self.nodes
            )
        return done

    def pending(self) -> list[Any]:
        return [ref for ref, r in self._rank_of.items() if r not in self.results]

    def wait(self, step_s: float = constants.SPOTLINE_POLL_INTERVAL_S) -> list[Any]:
        """Every rank's result, in rank order (blocking; for calls that are quick)."""
        while not self.poll(step_s):
            pass
        return [self.results[r] for r in sorted(self.refs)]


@dataclass
class ReplicaStart:
    """One replica on its way to ready (see the module)."""

    spec: JobSpec
    sealed: SealedJob
    device: str
    topos: list[Topology]
    """Its ranks by stage: their place in the group (a placeholder when started ahead:
    `reform` gives it its rank)."""
    attempt: str
    label: str
    """What the dashboard and messages call it: `replica-1` or `standby-<id>`."""
    pg: Any
    rehearse: bool = False
    gpu_fraction: float = 0.0
    names: list[str] | None = None
    clock: Callable[[], float] = time.monotonic
    actors: list[Any] = field(default_factory=list)
    infos: list[dict[str, Any]] = field(default_factory=list)
    phase: str = "placing"
    since: float = 0.0
    """When the phase in hand began (the clock's)."""
    _pending: list[Any] = field(default_factory=list)

    @classmethod
    def place(
        cls,
        spec: JobSpec,
        sealed: SealedJob,
        device: str,
        topos: list[Topology],
        attempt: str,
        label: str,
        avoid: set[str],
        clock: Callable[[], float] = time.monotonic,
        **kw: Any,
    ) -> ReplicaStart:
        """Ask Ray for the replica's placement group (never on a node in `avoid`: Ray's
        own node-id label on every bundle) and begin."""
        from ray.util.placement_group import placement_group

        stages = [worker_bundle(spec, device, t.stage) for t in topos]
        off = ",".join(sorted(avoid))
        pg = placement_group(
            stages,
            strategy="PACK",
            name=f"spotline:{spec.name}:{label}:{attempt}",
            bundle_label_selector=[{"ray.io/node-id": f"!in({off})"}] * len(stages)
            if avoid
            else None,
        )
        start = cls(spec, sealed, device, topos, attempt, label, pg, clock=clock, **kw)
        start.since = clock()
        start._pending = [pg.ready()]
        return start

    @property
    def placed(self) -> bool:
        return self.phase not in ("placing",)

    @property
    def ready(self) -> bool:
        return self.phase == "ready"

    def pending(self) -> list[Any]:
        """The refs of the phase in hand."""
        return list(self._pending)

    def bind(self, shares: list[tuple[int, str | None]]) -> None:
        """Started: set each rank's device environment ((LOCAL_RANK, visible devices) by
        stage) and import DeepSpeed there."""
        assert self.phase == "started", self.phase
        ifname = self.spec.resources.socket_ifname
        self._pending = [
            a.bind.remote(self.device, *share, ifname)
            for a, share in zip(self.actors, shares, strict=True)
        ]
        self._next("binding")

    def advance(self) -> None:
        """Take it one phase on where its calls returned; never waits. StartFailed."""
        import ray

        if self.phase in ("started", "ready"):
            return
        done, _ = ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
        if len(done) < len(self._pending):
            limit = constants.SPOTLINE_WORKER_START_TIMEOUT_S
            if self.clock() - self.since > limit:
                raise StartFailed(f"still {self.phase} after {limit:.0f}s")
            return
        try:
            results = ray.get(self._pending)
        except Exception as e:  # noqa: BLE001 - the owner ends it
            raise StartFailed(f"{self.phase} failed: {describe_failure(e)}") from e
        if self.phase == "placing":
            self._spawn()
        elif self.phase == "starting":
            self.infos = list(results)
            self._next("started")
        elif self.phase == "binding":
            for info, env in zip(self.infos, results, strict=True):
                info.update(
                    device=self.device,
                    local_rank=int(env["LOCAL_RANK"]),
                    visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
                )
            if self.rehearse:
                self._pending = [self.actors[0].host_store.remote(self.infos[0]["ip"])]
                self._next("hosting")
            else:
                self._next("ready")
        elif self.phase == "hosting":
            # The rehearsal: an engine among its own ranks, dropped at `reform`.
            addr, port = self.infos[0]["ip"], results[0]
            self._pending = [a.setup.remote(addr, port, None, False, True) for a in self.actors]
            self._next("rehearsing")
        elif self.phase == "rehearsing":
            self._next("ready")

    def _next(self, phase: str) -> None:
        self.phase, self.since = phase, self.clock()
        if phase in ("started", "ready"):
            self._pending = []

    def _spawn(self) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        for i, topo in enumerate(self.topos):
            where = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)
            bundle = worker_bundle(self.spec, self.device, topo.stage)
            self.actors.append(
                start_worker(
                    self.spec,
                    self.sealed,
                    topo,
                    self.attempt,
                    where,
                    bundle,
                    self.gpu_fraction,
                    self.names[i] if self.names else None,
                )
            )
        self._pending = [a.info.remote() for a in self.actors]
        self._next("starting")

    def where(self) -> str:
        """' on node <id>' once its ranks said where they run."""
        nodes = sorted({i["node_id"][:12] for i in self.infos if i.get("node_id")})
        return f" on node {', '.join(nodes)}" if nodes else ""

    def end(self) -> None:
        end(self.actors, [self.pg])


class GroupStart:
    """A group's start, one call to `advance` at a time (`RayWorkerGroup.start`): kept
    ranks re-form in their processes while each new replica goes through its
    `ReplicaStart`; then every rank's device environment, shared node by node; rank 0
    hosts the store; a balanced partition is measured and cut; every rank joins the
    process group and builds its engine (the rendezvous); peer memory is placed.

    It fills `actors`, `pgs`, `infos` and `sidecars` (by rank, or replica) in place, so
    the group that holds the same lists ends whatever a start left behind."""

    def __init__(
        self,
        spec: JobSpec,
        sealed: SealedJob,
        device: str,
        replicas: int,
        attempt: str,
        adopted: dict[int, Any],
        avoid: set[str],
        usable: list[dict[str, float]],
        clock: Callable[[], float] = time.monotonic,
        *,
        partition: list[int] | None = None,
        init: bool = True,
        sidecar: Callable[..., Any] | None = None,
        sidecar_gpu_fraction: float = 0.0,
        peers: Any = None,
        requested_device: str = "auto",
    ):
        self.spec, self.sealed, self.device, self.clock = spec, sealed, device, clock
        self.replicas, self.attempt, self.avoid, self.usable = replicas, attempt, avoid, usable
        self.pin, self.init, self.peers = partition, init, peers
        self.sidecar, self.sidecar_gpu_fraction = sidecar, sidecar_gpu_fraction
        self.requested_device = requested_device
        pp = spec.parallel.pipeline_stages
        self.topos = [Topology(pp, replicas, r) for r in range(pp * replicas)]
        self.actors: list[Any] = [None] * len(self.topos)
        self.pgs: list[Any] = [None] * replicas
        self.infos: list[dict[str, Any]] = [{} for _ in self.topos]
        self.sidecars: list[Any] = []
        self.devices: list[dict[str, Any]] = []
        self.partition: dict[str, Any] = {}
        for r, sv in adopted.items():
            self.pgs[r] = sv.pg
            for stage, actor in enumerate(sv.actors):
                self.actors[stage * replicas + r] = actor
                self.infos[stage * replicas + r] = dict(sv.infos[stage])
        kept = [t.rank for t in self.topos if t.replica in adopted]
        self.ahead = sum(1 for k in kept if adopted[self.topos[k].replica].ahead)
        self.kept = len(kept) - self.ahead
        self.timeout = constants.SPOTLINE_WORKER_START_TIMEOUT_S
        # Kept ranks re-form in their own processes while the new replicas are placed.
        reform = {k: (self.topos[k], attempt) for k in kept}
        self.calls: Calls | None = self._send("re-form", "reform", reform)
        self.starts = {
            r: ReplicaStart.place(
                spec,
                sealed,
                device,
                [t for t in self.topos if t.replica == r],
                attempt,
                f"replica-{r}",
                avoid,
                clock,
                gpu_fraction=sidecar_gpu_fraction,
            )
            for r in range(replicas)
            if r not in adopted
        }
        for r, st in self.starts.items():
            self.pgs[r] = st.pg
        self.step = "starting"
        self._probes: dict[int, Any] = {}
        self._to_probe: list[int] = []
        self._port = 0

    def _send(self, what: str, method: str, args: dict[int, tuple]) -> Calls:
        nodes = {t.rank: i.get("node_id", "") for t, i in zip(self.topos, self.infos, strict=True)}
        return Calls.send(what, self.actors, method, args, nodes, self.timeout, self.clock)

    def advance(self, timeout_s: float = 0.0) -> bool:
        """One step on (waiting at most `timeout_s` for a call of the step in hand to
        return); True once every rank is set up. WorkerFailure."""
        import ray

        if self.step == "ready":
            return True
        pending = [ref for st in self.starts.values() for ref in st.pending()]
        pending += self.calls.pending() if self.calls is not None else []
        if pending and timeout_s > 0:
            ray.wait(pending, num_returns=1, timeout=timeout_s)
        getattr(self, f"_{self.step}")()
        return self.step == "ready"

    def _replicas_on(self) -> bool:
        """Advance every new replica; True once all are past the phase they wait in."""
        for r, st in self.starts.items():
            try:
                st.advance()
            except StartFailed as e:
                self._failed(r, st, e)
        return all(st.phase in ("started", "ready") for st in self.starts.values())

    def _starting(self) -> None:
        """New replicas placed and their actors up, kept ranks re-formed: then every new
        rank's device environment, shared node by node, and the sidecars."""
        if not self._replicas_on() or not self.calls.poll():
            return
        for k, info in self.calls.results.items():
            # It keeps the environment it was bound with: CUDA read it once.
            was = self.infos[k]
            self.infos[k] = info | {
                n: was.get(n) for n in ("device", "local_rank", "visible_devices")
            }
        for st in self.starts.values():
            for t, actor, info in zip(st.topos, st.actors, st.infos, strict=True):
                self.actors[t.rank], self.infos[t.rank] = actor, dict(info)
        if self.calls.results:
            log.info(
                "%d rank(s) re-formed in their own processes (pids %s), %d of them started "
                "ahead; %d started anew",
                len(self.calls.results),
                ", ".join(str(self.infos[k]["pid"]) for k in sorted(self.calls.results)),
                self.ahead,
                sum(len(st.actors) for st in self.starts.values()),
            )
        check_one_device(self.device, [i["gpu_ids"] for i in self.infos])
        # Each new rank sees its node's GPUs and drives the one Ray gave it (LOCAL_RANK).
        shares = share_node_devices([(i["node_id"], i["gpu_ids"]) for i in self.infos])
        for st in self.starts.values():
            st.bind([shares[t.rank] for t in st.topos])
        if self.sidecar is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            for t in self.topos:
                where = PlacementGroupSchedulingStrategy(
                    self.pgs[t.replica], placement_group_bundle_index=t.stage
                )
                bundle = worker_bundle(self.spec, self.device, t.stage)
                self.sidecars.append(self.sidecar(t, where, bundle, self.attempt))
        self.calls, self.step = None, "binding"

    def _binding(self) -> None:
        """Every new rank bound: rank 0 hosts the torch.distributed store, already
        listening when its port is handed to the others."""
        if not self._replicas_on() or any(not st.ready for st in self.starts.values()):
            return
        for st in self.starts.values():
            for t, info in zip(st.topos, st.infos, strict=True):
                keys = ("device", "local_rank", "visible_devices")
                self.infos[t.rank].update({k: info.get(k) for k in keys})
        self.calls = self._send("rendezvous", "host_store", {0: (self.infos[0]["ip"],)})
        self.step = "hosting"

    def _hosting(self) -> None:
        """The store listens: measure for a balanced partition, then cut it."""
        if not self.calls.poll():
            return
        self._port = self.calls.results[0]
        log.info(
            "rendezvous of %d %s ranks at %s",
            len(self.topos),
            self.device,
            rendezvous_url(self.infos[0]["ip"], self._port),
        )
        pp = self.spec.parallel.pipeline_stages
        measure = self.spec.parallel.partition == "balanced" and pp > 1
        self._to_probe = [t.rank for t in self.topos] if measure else []
        self.calls, self.step = None, "probing"
        self._probing()

    def _probing(self) -> None:
        """Every worker's matmul speed (one rank at a time on CPU, where workers share
        the host's cores; all at once on GPUs), and on replica 0 of each stage every
        layer's forward + backward time; then the cut (`planning.choice`) and the
        rendezvous: every rank joins the process group and builds its engine."""
        from spotline.planning.choice import choose_partition

        if self.calls is not None:
            if not self.calls.poll():
                return
            self._probes.update(self.calls.results)
            self.calls = None
        if self._to_probe:
            ranks = self._to_probe if self.device == "gpu" else self._to_probe[:1]
            self._to_probe = [r for r in self._to_probe if r not in ranks]
            self.calls = self._send("probe", "probe", dict.fromkeys(ranks, ()))
            return
        probes = [self._probes[r] for r in sorted(self._probes)] or None
        self.partition = choose_partition(self.spec, self.replicas, probes, self.pin)
        args = (self.infos[0]["ip"], self._port, self.partition["bounds"], self.init)
        self.calls = self._send("rendezvous", "setup", {t.rank: args for t in self.topos})
        self.step = "rendezvous"

    def _rendezvous(self) -> None:
        """Every rank set up: peer memory (None back: no peer snapshots fit the nodes'
        budget)."""
        if not self.calls.poll():
            return
        self.devices = [self.calls.results[t.rank] for t in self.topos]
        self.calls, pairs = None, None
        if self.peers is not None:
            nodes = [i["node_id"] for i in self.infos]
            pairs = self.peers.place(nodes, self.replicas, self.partition["bounds"])
        if pairs is not None:
            self.calls = self._send("peer memory", "set_peers", dict(enumerate(pairs)))
        self.step = "peering"

    def _peering(self) -> None:
        if self.calls is None or self.calls.poll():
            self.calls, self.step = None, "ready"

    def _failed(self, replica: int, st: ReplicaStart, e: StartFailed) -> None:
        """WorkerFailure for a replica whose start failed: placement says what did not
        fit and what to change."""
        import ray

        ranks = [t.rank for t in st.topos]
        nodes = {t.rank: i.get("node_id", "") for t, i in zip(st.topos, st.infos, strict=False)}
        if st.phase != "placing":
            raise WorkerFailure("start", {f"replica {replica}{st.where()}: {e}": ranks}, nodes)
        stages = [worker_bundle(self.spec, self.device, t.stage) for t in st.topos]
        why = ""
        if self.device == "gpu" and not any(n.get("GPU", 0) > 0 for n in self.usable):
            why = (
                f"resources.device is {self.requested_device} and no live node has a GPU "
                "(the group waits for GPU nodes, it never runs on CPU); "
            )
        fresh = [t.rank for s in self.starts.values() for t in s.topos]
        raise WorkerFailure(
            "placement",
            {
                f"{why}{len(fresh)} {self.device.upper()} workers of {bundle_kinds(stages)} "
                f"could not be placed within {self.timeout:.0f}s (cluster has "
                f"{ray.available_resources()} free); add nodes or lower elastic.min_replicas "
                "/ resources.cpus_per_worker / resources.stages": fresh
            },
        )
