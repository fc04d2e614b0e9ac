"""A group of worker actors that train as one DeepSpeed job.

The controller only talks to the `WorkerGroup` interface (`progress.py`), so controller
tests swap in a fake group. `RayWorkerGroup` places one actor per device, with one
placement group per replica: its stages are the bundles, packed onto a node where
they fit (a worker and its sidecar share a bundle, so they share a device). Rank =
stage * replicas + replica, as DeepSpeed's grid expects.

`start` begins a group and returns at once; the caller moves it on with `advance`
until it is ready (`starter.GroupStart`: the one way ranks are started, also driven by
the replicas started ahead), so a controller never blocks on a start. `hand_over`
gives the next group the replicas whose ranks are all still good, and
`start(survivors=...)` adopts them (`survivors.py`): each rank re-forms in its own
process at its new rank, and only the missing replicas are placed and started anew.

Once started (`run`), the ranks train on their own; `poll` collects what they
published without ever waiting on a rank's training thread (every rank's heartbeat
included: a rank that stops answering keeps its last one, with how long it has been
silent), and `request` sends them messages (save at step k, stop at step k). A
sidecar factory, given by the caller, starts one extra actor per rank in the rank's
bundle (the backfill executors): the runtime does not know what it is.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from spotline.checkpoint import CheckpointStore, CorruptCheckpointError, Manifest
from spotline.config.schema import JobSpec
from spotline.heap import collection_held
from spotline.runtime.placement import usable_nodes
from spotline.runtime.progress import (
    PROCESS_DIED,
    Progress,
    RankBeat,
    WorkerFailure,
    collect,
    describe_failure,
    failure_cause,
    peer_failures,
)
from spotline.runtime.rendezvous import decide_device
from spotline.runtime.sealed import SealedJob
from spotline.runtime.starter import Calls, GroupStart
from spotline.runtime.survivors import Survivor, Survivors, adopt, end
from spotline.train.comms import reform_grace_s
from spotline.train.process import Topology, backend_for, sticky_cuda_error
from spotline.train.watch import CommsHung

log = logging.getLogger("spotline.group")

Sidecar = Callable[[Topology, Any, dict[str, float], str], Any]
"""(topology, scheduling strategy of the rank's bundle, the bundle, attempt) -> actor."""


class RayWorkerGroup:
    def __init__(
        self,
        spec: JobSpec,
        replicas: int,
        store: CheckpointStore,
        device: str,
        sidecar: Sidecar | None = None,
        sidecar_gpu_fraction: float = 0.0,
        avoid: set[str] | None = None,
        peers: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.spec = spec
        self.clock = clock
        self.peers = peers
        """The job's state keepers (`spotline.runtime.peers.PeerMemory`), or None."""
        self.restored_bytes = 0
        """Bytes the ranks read in the latest restore (from storage or peer memory)."""
        self.avoid = avoid if avoid is not None else set()
        """Node IDs no rank may be placed on (cordoned), read at `start`."""
        self.replicas = replicas
        self.store = store
        self.requested_device = device
        self.device = device if device != "auto" else "cpu"
        """The device this group runs on ('gpu' or 'cpu'), decided in `start`."""
        self.sidecar = sidecar
        self.sidecar_gpu_fraction = sidecar_gpu_fraction if sidecar is not None else 0.0
        self.pp = spec.parallel.pipeline_stages
        self.world_size = self.pp * replicas
        self.attempt = uuid.uuid4().hex[:8]
        self.pgs: list[Any] = []  # one placement group per replica
        self.kept = 0
        """Ranks adopted from the previous group (their processes kept), at `start`."""
        self.ahead = 0
        """Ranks that joined from replicas started ahead (`standby.py`), at `start`."""
        self.left_behind: dict[int, str] = {}
        """Rank -> why `hand_over` could not keep it."""
        self.comms_hung: dict[str, str] = {}
        """node -> why, for each node where a rank's abort hung at `hand_over`."""
        self.actors: list[Any] = []
        self.sidecars: list[Any] = []  # one per rank, when a sidecar factory is given
        self._info: list[dict[str, Any]] = []
        self._start: GroupStart | None = None  # in hand between `start` and ready
        self._devices: list[dict[str, Any]] = []  # per rank: device name and peak FLOP/s
        self._partition: dict[str, Any] = {}  # the stage partition in force, and why
        self._runs: list[Any] = []  # each rank's run() ref
        self._finished: dict[int, dict[str, Any]] = {}
        self._polls: dict[int, Any] = {}  # rank -> its progress() ref still out
        # Ranks whose run had returned when their latest progress() was sent: that
        # report holds all they will ever publish (the final save included).
        self._drained: set[int] = set()
        self._final_polls: set[int] = set()
        self._saves: dict[int, dict[int, tuple[float, int]]] = {}  # step -> rank -> report
        # rank -> (monotonic time of its latest answered poll, the heartbeat it carried)
        self._heard: dict[int, tuple[float, dict[str, Any] | None]] = {}

    # --- helpers ------------------------------------------------------------------

    def _call_all(
        self, what: str, method: str, *args: Any, per_rank_args=None, timeout_s=None, ranks=None
    ) -> list[Any]:
        """Call `method` on every rank (or on `ranks`, in that order) and wait; any dead or
        raising rank -> WorkerFailure (every peer that failed with it grouped). Only for
        calls that return quickly: the start never waits this way (`advance`)."""
        return self._send(what, method, *args, per_rank_args=per_rank_args, ranks=ranks,
                          timeout_s=timeout_s).wait()  # fmt: skip

    def _send(
        self, what: str, method: str, *args: Any, per_rank_args=None, timeout_s=None, ranks=None
    ) -> Calls:
        called = list(range(len(self.actors))) if ranks is None else list(ranks)
        calls = {r: per_rank_args[r] if per_rank_args else args for r in called}
        return Calls.send(what, self.actors, method, calls, self._nodes(), timeout_s, self.clock)

    def _raise_failure(self, what, first_rank, first_exc, futures, rank_of) -> None:
        """WorkerFailure for `first_rank`'s error, with every peer that failed with it."""
        errors, causes, silent = peer_failures(first_rank, first_exc, futures, rank_of)
        raise WorkerFailure(what, errors, self._nodes(), causes, silent)

    def _nodes(self) -> dict[int, str]:
        return {i["rank"]: i["node_id"] for i in self.worker_info()}

    # --- start-up ---------------------------------------------------------------------

    def start(
        self,
        partition: list[int] | None = None,
        init: bool = True,
        survivors: Survivors | None = None,
    ) -> None:
        """Begin placing and starting the ranks, and return at once: `advance` moves the
        start on (`starter.GroupStart`). `partition`: the layer bounds to run at (a
        resumed job's recorded ones, or a re-partition); None: parallel.partition
        decides. `init=False`: the ranks leave their weights empty for the `restore`
        that follows (a rank refuses to train before it loaded one). `survivors`: ranks
        of the previous group to adopt (see the module); this group owns them from here
        and ends those it has no place for."""
        # Decided from the nodes there are now, at every start: an 'auto' job that began
        # on CPU moves to GPUs at its next start once a GPU node is up.
        usable = usable_nodes()
        self.device = decide_device(self.requested_device, usable)
        adopted = adopt(survivors or Survivors(), self.replicas, self.device, self.avoid)
        self._start = GroupStart(
            self.spec,
            SealedJob(self.spec, self.store),  # kept while the workers live: secrets
            self.device,
            self.replicas,
            self.attempt,
            adopted,
            self.avoid,
            usable,
            self.clock,
            partition=partition,
            init=init,
            sidecar=self.sidecar,
            sidecar_gpu_fraction=self.sidecar_gpu_fraction,
            peers=self.peers,
            requested_device=self.requested_device,
        )
        st = self._start
        # The same lists, filled in as the start goes: a shutdown meanwhile ends them.
        self.actors, self.pgs, self._info, self.sidecars = st.actors, st.pgs, st.infos, st.sidecars
        self.kept, self.ahead = st.kept, st.ahead

    def advance(self, timeout_s: float = 0.0) -> bool:
        """Move the start on, waiting at most `timeout_s` for a call to return: True once
        every rank is set up and the group can restore. A rank that fails, or a phase
        that outruns SPOTLINE_WORKER_START_TIMEOUT_S, raises WorkerFailure."""
        st = self._start
        if st is None:
            return True
        if not st.advance(timeout_s):
            return False
        self._devices, self._partition = st.devices, st.partition
        self._start = None
        return True

    def hand_over(self, leaving: set[str], grace_s: float | None = None) -> Survivors:
        """The replicas of this ended group the next one may adopt: every rank of one
        alive, off the nodes of `leaving` (lost, noticed, cordoned), and with its run
        returned within `grace_s` (recovery.reform_grace_s; None: its backend's,
        `comms.reform_grace_s`). A rank still blocked in a collective after that is not
        kept, nor is its replica: they end with this group; nor is one whose abort hung
        (`comms_hung` names its node, for the controller to cordon). They leave this
        group, so `shutdown` ends only the rest."""
        import ray

        out = Survivors()
        self.comms_hung = {}
        if not self._runs or len(self._info) != len(self.actors):
            return out  # the group never ran: nothing in it is known to be good
        grace_s = reform_grace_s(backend_for(self.device), grace_s)
        stays = [k for k in range(len(self._runs)) if self._info[k]["node_id"] not in leaving]
        # A rank blocked in a collective fails now, on gloo and NCCL alike.
        cuts = {self.actors[k].abort_comms.remote(self.attempt): k for k in stays}
        waited = [self._runs[k] for k in stays] + list(cuts)
        done = set(ray.wait(waited, num_returns=len(waited), timeout=grace_s)[0])
        hung: dict[int, BaseException] = {}
        for ref in done.intersection(cuts):  # read, so that Ray reports no unread error
            with contextlib.suppress(Exception):
                cut = ray.get(ref)
                if getattr(cut, "hung", None) is not None:
                    hung[cuts[ref]] = cut.hung

        def why_not(rank: int) -> str | None:
            error = hung.get(rank)
            if error is None and self._runs[rank] in done:
                try:
                    ray.get(self._runs[rank])
                except Exception as e:  # noqa: BLE001 - judged by why_not_kept
                    error = e
            goes = self._info[rank]["node_id"] in leaving
            returned = self._runs[rank] in done or rank in hung
            return why_not_kept(goes, returned, error, grace_s)

        self.left_behind = {}
        for r in range(self.replicas):
            ranks = [s * self.replicas + r for s in range(self.pp)]
            whys = {k: why_not(k) for k in ranks}
            self.left_behind.update({k: w for k, w in whys.items() if w is not None})
            for k, w in whys.items():  # an abort that hung: its node is to be cordoned
                if w is not None and w.startswith(_HUNG):
                    why = w.removeprefix(_HUNG)
                    self.comms_hung[self._info[k]["node_id"]] = f"rank {k} there: {why}"
            if self.pgs[r] is None or any(whys.values()):
                continue
            out.replicas.append(
                Survivor(
                    [self.actors[k] for k in ranks],
                    self.pgs[r],
                    [dict(self._info[k]) for k in ranks],
                )
            )
            for k in ranks:
                self.actors[k] = None
            self.pgs[r] = None
        return out

    def partition(self) -> dict[str, Any]:
        """The stage partition in force: bounds, layers per stage, and (balanced) the
        measured layer times and stage speeds it was cut by."""
        return dict(self._partition)

    def restore(self, manifest: Manifest, source: str | None = None) -> int:
        """Two phases (`source`: the root URI the step lies under, when it is not the
        job's own checkpoint.uri). `fetch_checkpoint`: each rank reads what it needs and verifies every
        byte before it changes its engine's tensors. `load_checkpoint`, only once every
        rank's fetch succeeded: step, RNG and lr. A corrupt file found by any rank raises
        CorruptCheckpointError before any rank trains on the step; the controller then
        loads an older step into every rank, which overwrites all of the state (no rank
        keeps a part of the bad step). A file that verifies but does not parse is
        corrupt too."""
        import ray

        # Put once: every rank reads the same object, not a copy per call (a manifest
        # of thousands of ranks is megabytes).
        text = ray.put(manifest.to_json())
        fetched = self._corrupt_or_failure(
            lambda: self._call_all(
                f"read of checkpoint step {manifest.step}", "fetch_checkpoint", text, source
            )
        )
        self.restored_bytes = sum(f["bytes_read"] for f in fetched)
        steps = self._corrupt_or_failure(
            lambda: self._call_all(f"load of checkpoint step {manifest.step}", "load_checkpoint")
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

    # --- free-running training ----------------------------------------------------------

    def run(self, target: int, peer_every: int = 0) -> None:
        """Every rank trains to `target` on its own from here; nothing waits for it.
        `peer_every`: see `TrainWorker.run`."""
        self._runs = [a.run.remote(target, peer_every) for a in self.actors]
        now = time.monotonic()
        self._heard = {rank: (now, None) for rank in range(len(self.actors))}
        self._finished = {}
        self._drained = set()
        self._final_polls = set()

    def request(
        self, save_at: int = 0, stop_at: int = 0, reason: str = "", peer_every: int = 0
    ) -> None:
        """Ask every rank to save at / stop after a step, or to take peer copies every
        `peer_every` steps; does not wait."""
        for a in self.actors:
            a.request.remote(save_at, stop_at, reason, peer_every)

    def poll(self, timeout_s: float) -> Progress:
        """Collect what the ranks published, about every `timeout_s`: it first waits that
        long, or until some rank's run ends (it finished, raised, or its process died),
        so that polling costs the ranks a few calls a second, never a busy loop. A rank
        whose run raised, or whose process died, raises WorkerFailure."""
        import ray

        running = [ref for rank, ref in enumerate(self._runs) if rank not in self._finished]
        if running:
            ray.wait(running, num_returns=1, timeout=timeout_s)
        self._check_runs()
        for rank, actor in enumerate(self.actors):
            if rank not in self._polls:
                self._polls[rank] = actor.progress.remote()
                if rank in self._finished:
                    self._final_polls.add(rank)
        refs = list(self._polls.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        ready_set = set(ready)
        answered = [rank for rank, ref in self._polls.items() if ref in ready_set]
        # Thousands of reports, and what they fold to, are a burst of containers: automatic
        # collection waits while they are taken in (`spotline.heap`). Only the answered
        # reports are taken, which `ray.wait` has already brought to this node: nothing
        # in the block waits on Ray.
        with collection_held():
            progress, failed = self._take_reports(answered)
        try:
            if failed is not None:
                self._raise_failure("training", *failed, list(self._runs), self._rank_of())
            self._check_runs()
        except WorkerFailure as e:
            e.progress = progress  # the living ranks' losses and uploads still count
            raise
        return progress

    def _take_reports(
        self, answered: list[int]
    ) -> tuple[Progress, tuple[int, BaseException] | None]:
        """The progress the `answered` ranks' reports make, and the first rank whose
        progress call raised (with what it raised)."""
        reports: list[dict[str, Any]] = []
        failed: tuple[int, BaseException] | None = None
        for rank, (report, error) in zip(
            answered, collect([self._polls[r] for r in answered]), strict=True
        ):
            del self._polls[rank]
            if rank in self._final_polls:
                self._drained.add(rank)
            if error is None:
                reports.append(report)
            else:
                failed = failed or (rank, error)
        return self._progress(reports), failed

    def _progress(self, reports: list[dict[str, Any]]) -> Progress:
        """The snapshot a poll's reports make: what they carried, and every rank's beat."""
        progress = self._fold(reports)
        progress.ranks = self._beats(reports)
        return progress

    def _beats(self, reports: list[dict[str, Any]]) -> list[RankBeat]:
        """Every rank's latest heartbeat (a silent rank keeps its last one) and the
        compute its report of this poll carried."""
        now = time.monotonic()
        compute: dict[int, dict[str, Any]] = {}
        for r in reports:
            self._heard[r["rank"]] = (now, r.get("beat"))
            compute[r["rank"]] = r.get("compute") or {}
        out = []
        starting = {"step": 0, "phase": "starting", "phase_s": 0.0}
        for rank in range(len(self.actors)):
            stage, replica = divmod(rank, self.replicas)  # as `Topology` places a rank
            heard_at, beat = self._heard.get(rank, (now, None))
            beat = beat or starting
            c = compute.get(rank, {})
            out.append(
                RankBeat(
                    rank=rank,
                    stage=stage,
                    replica=replica,
                    node=self._info[rank]["node_id"] if rank < len(self._info) else "",
                    step=beat["step"],
                    phase=beat["phase"],
                    phase_s=beat["phase_s"],
                    silent_s=now - heard_at,
                    running=rank not in self._finished,
                    compute_steps=c.get("steps", 0),
                    compute_s=c.get("compute_s", 0.0),
                )
            )
        return out

    def _rank_of(self) -> dict[Any, int]:
        return {ref: r for r, ref in enumerate(self._runs)}

    def _check_runs(self) -> None:
        import ray

        if not self._runs:
            return
        ready, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        rank_of = self._rank_of()
        for ref in ready:
            rank = rank_of[ref]
            if rank in self._finished:
                continue
            try:
                self._finished[rank] = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - grouped and re-raised
                self._raise_failure("training", rank, e, list(self._runs), rank_of)

    def _fold(self, reports: list[dict[str, Any]]) -> Progress:
        out = Progress()
        for r in sorted(reports, key=lambda r: r["rank"]):
            if r["rank"] == 0:
                out.steps = r["steps"]
                out.lr = r["lr"]
                out.batch = r.get("batch")
                out.skipped_saves = r.get("skipped", [])
            for step, blocked, nbytes in r["saves"]:
                self._saves.setdefault(step, {})[r["rank"]] = (blocked, nbytes)
            out.uploads += r["uploads"]
            out.uploading = out.uploading or r["uploading"]
            out.notices += r["notices"]
            if r.get("bubbles"):
                out.bubbles.append(r["bubbles"])
            out.data_stall_s = max(out.data_stall_s, r["data_stall_s"])
            if r.get("memory"):
                out.memory.append(r["memory"])
            out.peer += r.get("peer", []) + r.get("peer_sent", [])
        for step in sorted(self._saves):
            by_rank = self._saves[step]
            if len(by_rank) == self.world_size:
                del self._saves[step]
                out.saves[step] = max(b for b, _ in by_rank.values())
                out.save_bytes[step] = sum(n for _, n in by_rank.values())
        # Finished once every rank's run returned AND a report sent after that came
        # back: a report taken while the run was ending may miss its last save.
        done = self._runs and len(self._drained) == len(self._runs)
        if done and not self._saves:
            out.finished = self._finished[0]
        return out

    def wait_uploads(self, timeout_s: float) -> bool:
        """True once every rank's uploads finished (their results come through poll)."""
        import ray

        refs = [a.wait_uploads.remote(timeout_s) for a in self.actors]
        return all(ray.get(refs, timeout=timeout_s + 30))

    # --- the rest -----------------------------------------------------------------------

    def executors(self) -> list[Any]:
        return list(self.sidecars)

    def peak_flops(self) -> float | None:
        """Peak FLOP/s of one device of this group (the slowest), None if unknown."""
        peaks = [d.get("peak_flops") for d in self._devices]
        return min(peaks) if peaks and None not in peaks else None

    def node_ids(self) -> set[str]:
        """The nodes of the ranks known to run (while starting: those that said so)."""
        return {i["node_id"] for i in self.worker_info()}

    def heldout_loss(self) -> float:
        return self._call_all("held-out evaluation", "heldout_loss")[0]

    def worker_info(self) -> list[dict[str, Any]]:
        """Where each rank runs (rank, pid, node, ...), of the ranks known to run."""
        return [dict(i) for i in self._info if "node_id" in i]

    def shutdown(self) -> None:
        end(self.sidecars + [a for a in self.actors if a is not None], self.pgs)
        self.actors = []
        self.sidecars = []
        self.pgs = []
        self._runs = []
        self._polls = {}
        self._drained = set()
        self._final_polls = set()
        self._heard = {}


_HUNG = "hung: "
"""How `why_not_kept` starts the reason of a rank whose abort or destroy hung."""


def why_not_kept(
    node_goes: bool, returned: bool, error: BaseException | None, grace_s: float
) -> str | None:
    """Why `hand_over` cannot keep a rank of an ended group, or None when it can: its
    run `returned` within `grace_s`, with `error` (None: it returned a result). A
    collective's error leaves the process good to re-form in; a sticky CUDA error does
    not, nor an abort that hung (`error` a CommsHung, however it came), and such a
    rank's process ends with its group."""
    if node_goes:
        return "its node goes"
    cause = failure_cause(error) if error is not None else None
    if isinstance(cause, CommsHung):
        return f"{_HUNG}{cause.short}"
    if not returned:
        return f"still in its step {grace_s:.0f}s after the failure"
    if error is None:
        return None
    if describe_failure(error) == PROCESS_DIED:
        return "its process died"
    sticky = sticky_cuda_error(f"{error} {failure_cause(error)}")
    if sticky:
        return f"its GPU hit a sticky CUDA error ({sticky}), which only a new process clears"
    return None
