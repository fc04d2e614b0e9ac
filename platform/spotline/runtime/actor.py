"""The Ray actor that hosts one rank: a `Trainer` that trains on its own.

`run(target)` trains from the rank's current step to `target` without stopping for
anyone: periodic checkpoints (every checkpoint.interval_steps) are taken at the same
step on every rank by construction, and what the controller asks for (checkpoint at
step k, stop at step k) arrives through `request`, on its own concurrency group
("control"), while the loop runs. After every step the ranks agree on those requests
with one all-reduce of two integers (what was one of one integer), so they all save
or stop at the same step boundary. A SIGTERM to the process (when the job watches
for it) asks the same, at once.

A save blocks training only for its host copy; serialization and upload run on the
rank's upload thread. Progress (losses, step times, saves, finished uploads, bubbles,
notices) is published into a buffer that the controller drains with `progress`,
which never touches the training thread. Nothing here calls the controller.

A rank that survives its group (recovery.in_place) takes its place in the next one
with `reform`: the same process, a new rank, a new engine, the state restored.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
import os
import shutil
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import ray

from spotline import constants
from spotline.bubbles.channel import WindowChannel
from spotline.bubbles.recorder import METERED, bubble_report
from spotline.checkpoint import CorruptCheckpointError, Manifest, StorageError
from spotline.checkpoint.layout import CheckpointFormatError
from spotline.checkpoint.node_receipts import NodeReceipts
from spotline.checkpoint.staging import check_local_dir
from spotline.checkpoint.transfer import Uploader
from spotline.config.loader import SpecError
from spotline.config.redact import install_log_redaction
from spotline.config.schema import JobSpec
from spotline.metrics.mfu import device_peak
from spotline.metrics.prometheus import Metrics, export_gpu_samples
from spotline.metrics.tensor_memory import measure_peak
from spotline.preemption import make_source
from spotline.registry import blames_user_code
from spotline.runtime.cpu import pin_process
from spotline.runtime.faults import Faults
from spotline.runtime.peers import PeerReader, PeerSender
from spotline.runtime.rendezvous import interface_of, worker_env
from spotline.runtime.sealed import SealedJob
from spotline.train.comms import Comms, CommsHung, Cut, comms_for
from spotline.train.process import (
    Topology,
    backend_for,
    import_deepspeed,
    init_distributed,
    leave_distributed,
    sticky_cuda_error,
    use_device,
)
from spotline.train.trainer import Trainer

log = logging.getLogger("spotline.worker")


_PEER_LOSSES = 10_000
"""Steps whose losses rank 0's peer copies carry (the newest)."""


def channel_path(spec: JobSpec, attempt: str, rank: int) -> str:
    """Where a rank's trainer and backfill executor share their window channel."""
    root = Path(spec.checkpoint.staging_dir) / spec.name / attempt
    return str(root / f"window_rank_{rank:05d}.chan")


@dataclasses.dataclass
class _Requests:
    """What the controller asked for, as steps (0: nothing asked)."""

    save_at: int = 0
    stop_at: int = 0
    reason: str = ""
    peer_every: int = 0


def _empty_report() -> dict[str, Any]:
    """What a rank publishes between two progress() calls, before anything happened."""
    return {"steps": [], "saves": [], "notices": [], "memory": None, "peer": [], "skipped": []}


class TrainWorker:
    def __init__(self, job: SealedJob, topo: Topology, attempt: str):
        install_log_redaction()
        self.spec, self.store = job.open()
        self.trainer: Trainer | None = None
        self.channel: WindowChannel | None = None
        self.metrics: Metrics | None = None
        self._lock = threading.Lock()  # the control thread and the training thread
        self.device = "cpu"  # the group's, and this rank's place on its node (`bind`)
        self.local_rank = 0
        self._sigterm = None
        self._sigterm_reported = False
        self._node_id = ray.get_runtime_context().get_node_id()  # for what it says
        self._sticky: str | None = None  # a sticky CUDA error this process hit (`run`)
        self._hung: CommsHung | None = None  # its abort or destroy hung: never kept
        sigterm = [s for s in self.spec.preemption.sources if s.kind == "sigterm"]
        if sigterm:
            # Actor construction runs on the process's main thread, where Python
            # delivers signals; training runs on a worker thread and polls the source.
            self._sigterm = make_source(sigterm[0], node_id=self._node_id)
            self._sigterm.install()
        self._join(topo, attempt)

    def _join(self, topo: Topology, attempt: str) -> None:
        """Take rank `topo` of group `attempt`: what a rank holds for one group."""
        self.topo = topo
        self.attempt = attempt
        root = Path(self.spec.checkpoint.staging_dir) / self.spec.name
        self.staging = root / attempt / f"rank_{topo.rank:05d}"
        cap = self.spec.checkpoint.upload_max_mb_per_s
        node = NodeReceipts(root / attempt / "node_receipts", topo.rank)
        node.join()
        self.uploader = Uploader(
            self.store,
            self.spec,
            topo.rank,
            topo.world_size,
            attempt,
            None if cap is None else cap * 1e6,
            node,
        )
        self.faults: Faults | None = None
        self._req = _Requests()
        self._buf = _empty_report()
        self._steps_run = 0  # steps this rank trained in this group (peak memory: once)
        # (step, loss) trained since this rank's last save: rank 0's receipt carries them,
        # so a step committed from receipts keeps its losses when the reports died.
        self._unsaved_losses: list[tuple[int, float]] = []
        # (step, loss) of this group's latest steps: rank 0's peer copies carry them,
        # so a step restored from peer memory keeps the losses its reports never sent.
        self._recent_losses: collections.deque[tuple[int, float]] = collections.deque(
            maxlen=_PEER_LOSSES
        )
        self._stall_seen = 0.0
        self._filled_seen = (0,) * len(METERED)  # the channel's meters already reported
        self._restored: Any = None  # what fetch_checkpoint read, for load_checkpoint
        self._own_keeper: str | None = None  # this node's state keeper (`set_peers`)
        self._store: Any = None  # rank 0: the rendezvous store, listening (`host_store`)
        self._comms: Comms | None = None  # what cuts this rank's communicators (`setup`)

    def reform(self, topo: Topology, attempt: str) -> dict[str, Any]:
        """Take rank `topo` of the next group (`attempt`) in this process, once the group
        it trained in ended (its run returned). Drops the engine, the old group's upload
        queue and process group (a destroy that hangs raises CommsHung), keeps what a new
        process would build again (imports, device and context, environment); the group
        then sets it up and restores it. Returns `info`."""
        if self._hung is not None or self._sticky is not None:  # never kept: guards
            raise self._hung or RuntimeError(
                f"rank {self.topo.rank} cannot re-form in its process: its GPU hit a "
                f"sticky CUDA error ({self._sticky}) that only a new process clears"
            )
        trainer, self.trainer = self.trainer, None
        if trainer is not None:
            trainer.close()
        del trainer  # the engine, and with it the old group's communicators
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        self.uploader.close()
        try:  # under a watchdog
            leave_distributed(self.topo.rank, self._node_id)
        except CommsHung as e:
            self._hung = e
            raise
        gc.collect()
        self._join(topo, attempt)
        return self.info()

    # --- start-up -----------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {
            "rank": self.topo.rank,
            "pid": os.getpid(),
            "node_id": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
        }

    def bind(
        self, device: str, local_rank: int, visible: str | None, socket_ifname: str | None
    ) -> dict[str, str]:
        """Set this rank's device environment (the group's device, its node's shared GPUs,
        its local rank, the socket interface), then import DeepSpeed: CUDA reads
        CUDA_VISIBLE_DEVICES once, at its first use, and DeepSpeed's import is one. The
        device itself is taken (and checked) by the first call that uses it, `probe` or
        `setup`. Returns the environment set."""
        ifname = socket_ifname or interface_of(ray.util.get_node_ip_address())
        env = worker_env(device, local_rank, visible, ifname)
        os.environ.update(env)
        self.device, self.local_rank = device, local_rank
        import_deepspeed()
        return env

    def host_store(self, host: str) -> int:
        """Rank 0: start the rendezvous store, listening on a port the kernel picks, and
        keep it; returns the port. Nothing is released between choosing the port and
        listening on it, so no other process can take it."""
        import torch.distributed as dist

        self._store = dist.TCPStore(
            host,
            0,
            self.topo.world_size,
            is_master=True,
            timeout=timedelta(seconds=self.spec.failure.collective_timeout_s),
            wait_for_workers=False,
        )
        return self._store.port

    def set_peers(self, own: str, buddy: str | None) -> None:
        """Send every save's files, and a peer copy every `peer_every` steps, to this
        node's state keeper `own` and to `buddy` on another node (None: none there)."""
        self._own_keeper = own
        keepers = [own] if buddy is None else [own, buddy]
        self.uploader.peer = PeerSender(self.topo.rank, self.topo.world_size, self.attempt, keepers)

    def _threads(self) -> int:
        """This worker's torch thread budget: its stage's CPUs."""
        return max(1, int(self.spec.resources.stage(self.topo.stage).cpus))

    @blames_user_code
    def probe(self) -> dict[str, Any]:
        """This worker's speed and memory, and on replica 0 of each stage each layer's
        cost on this device: what the balanced stage partition is cut by. Runs before
        the process group exists."""
        from spotline.train.profile import probe

        use_device(self.device, self.local_rank, self.topo.rank)
        if constants.SPOTLINE_PIN_CORES:
            pin_process(self.topo.rank)
        return probe(
            self.spec,
            self.topo.rank,
            self._threads(),
            layers=self.topo.replica == 0,
            replicas=self.topo.replicas,
        )

    @blames_user_code
    def setup(
        self,
        master_addr: str,
        master_port: int,
        bounds: list[int] | None = None,
        init: bool = True,
        rehearsal: bool = False,
    ) -> dict[str, Any]:
        """Join the process group and build this rank's engine (`init=False`: its weights
        are left empty for the checkpoint the group restores next). `rehearsal`: a
        replica started ahead (`spotline.runtime.standby`) builds one among its own
        ranks, so that the first-time costs of a process (imports, the first engine)
        are paid before a group needs it; it touches no other group's staging files."""
        if constants.SPOTLINE_PIN_CORES and not rehearsal:
            pin_process(self.topo.rank)
        # This node's disk, checked before the first step rather than at the first save.
        check_local_dir(self.staging, "checkpoint.staging_dir")
        # Every receipt this rank writes is signed: a node without the key fails here,
        # naming the variable, rather than losing each checkpoint to it.
        try:
            self.store.signing_key()
        except StorageError as e:
            raise SpecError(str(e)) from None
        if not rehearsal:
            self._clean_staging()
        store, self._store = self._store, None  # the process group owns it from here
        self._comms = comms_for(backend_for(self.device), self.topo.rank, self._node_id)
        self._comms.begin()
        backend = init_distributed(
            self.topo,
            master_addr,
            master_port,
            self.device,
            self.local_rank,
            store,
            self.spec.failure.collective_timeout_s,
        )
        threads = self._threads()
        if self.spec.backfill.enabled:
            self.channel = WindowChannel(
                channel_path(self.spec, self.attempt, self.topo.rank), create=True
            )
        name, peak = device_peak(self.spec.parallel.precision_on(self.device), threads)
        self.faults = Faults.for_rank(self.spec, self.topo.rank, self._node_id)  # tests only
        self.trainer = Trainer(
            self.spec,
            self.topo,
            threads=threads,
            window_channel=self.channel,
            bounds=bounds,
            flops_per_s=peak,
            init=init,
            engine_hook=self.faults.wrap_engine if self.faults is not None else None,
        )
        if self.topo.world_size > 1:  # what the cut needs known (gloo: every rank's listeners)
            from spotline.compat.torch import default_store

            timeout = self.spec.failure.collective_timeout_s
            self._comms.agree(default_store(), self.topo.world_size, timeout)
        if self.metrics is None:  # one per process: a re-formed rank keeps its series
            self.metrics = Metrics(self.spec.name)
        return {"backend": backend, "device": name, "peak_flops": peak}

    def _clean_staging(self) -> None:
        """Drop what earlier groups of this job left on this node (a save cut off by a
        kill, an old window channel): a new group starts only after the old one is
        gone, and the next restore reads from storage, never from here."""
        root = self.staging.parent.parent
        for old in root.iterdir():
            if old.name != self.attempt and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)

    # --- restore: read everything first, then load ----------------------------------

    @blames_user_code
    def fetch_checkpoint(self, manifest_json: str, source: str | None = None) -> dict[str, Any]:
        """Read (ranged, sha256-verified) just what this rank needs of a committed step
        (under `source`, a root URI, when it is not the job's own); raises
        CorruptCheckpointError before anything is loaded."""
        assert self.trainer is not None
        manifest = Manifest.from_json(manifest_json)
        if source == "peer":  # live keepers' memory (`spotline.checkpoint.peer`)
            store = PeerReader(manifest, self._own_keeper)
        else:
            store = self.store.sibling(source) if source else self.store
        try:
            self._restored = self.trainer.fetch(manifest, store)
        except CheckpointFormatError as e:
            raise CorruptCheckpointError(manifest.step, e.path, e.reason, uri=store.uri) from None
        return {"rank": self.topo.rank, "bytes_read": self._restored.bytes_read}

    @blames_user_code
    def load_checkpoint(self) -> int:
        assert self.trainer is not None and self._restored is not None
        fetched, self._restored = self._restored, None
        self.trainer.load(fetched)
        return self.trainer.step

    # --- steady state -------------------------------------------------------------

    @ray.method(concurrency_group="control")
    def request(self, save_at: int, stop_at: int, reason: str, peer_every: int = 0) -> None:
        """Checkpoint at step `save_at` and/or stop after step `stop_at` (0: not asked; a
        step already passed means the next boundary). Every rank acts at the same step.
        The earliest stop asked for wins: a just-in-time checkpoint can be moved up.
        `peer_every` > 0: take a peer copy every that many steps from the next step
        on (the ranks agree on it as on the rest)."""
        log.info(
            "rank %d: asked to save at %d, stop at %d (%s)",
            self.topo.rank,
            save_at,
            stop_at,
            reason,
        )
        with self._lock:
            self._req.save_at = max(self._req.save_at, save_at)
            if stop_at > 0:
                held = self._req.stop_at
                self._req.stop_at = min(held, stop_at) if held > 0 else stop_at
            self._req.reason = reason or self._req.reason
            if peer_every > 0:
                self._req.peer_every = peer_every

    @ray.method(concurrency_group="control")
    def progress(self) -> dict[str, Any]:
        """What happened since the last call; never waits for the training thread."""
        with self._lock:
            buf, self._buf = self._buf, _empty_report()
        trainer = self.trainer
        stall = trainer.data_stall_s if trainer else 0.0
        rec = self.trainer.recorder if self.trainer else None
        bubbles, self._filled_seen = bubble_report(rec, self.channel, self.topo, self._filled_seen)
        if bubbles is not None:  # a pipeline stage: its forward and backward instructions
            compute = (bubbles["steps"], bubbles["passes_s"])
        elif trainer is not None and trainer.compute is not None:
            compute = trainer.compute.take()
        else:
            compute = (0, 0.0)
        out = {
            "rank": self.topo.rank,
            **buf,
            "uploads": self.uploader.take_done(),
            "peer_sent": [dict(r, rank=self.topo.rank) for r in self.uploader.take_peer_done()],
            "uploading": self.uploader.busy,
            "bubbles": bubbles,
            "beat": trainer.heartbeat.read() if trainer else None,
            "compute": {"steps": compute[0], "compute_s": compute[1]},
            "lr": trainer.lr() if trainer else None,
            "batch": trainer.batch_info() if trainer else None,
            "data_stall_s": stall - self._stall_seen,
        }
        self._stall_seen = stall
        return out

    @blames_user_code
    def run(self, target: int, peer_every: int = 0) -> dict[str, Any]:
        """Train to step `target`, or until every rank agreed to stop; returns where.

        A request to save at step k is served by the first save at a step >= k
        (a periodic one included); a stop always saves at the step it stops at.
        `peer_every`: steps between peer copies (0: none until the controller asks;
        -1: one after the warm-up steps, whose cost the controller measures k by).
        """
        assert self.trainer is not None
        tr = self.trainer
        if peer_every:  # -1 (measure first) as much as a k: what the controller asked
            with self._lock:
                self._req.peer_every = peer_every
        interval = self.spec.checkpoint.interval_steps
        self._export_devices()
        saved_through = tr.step  # the same on every rank: it follows agreed decisions
        try:
            return self._train(tr, target, interval, saved_through)
        except BaseException as e:
            # This group is over: peers waiting on this rank fail now, not at the timeout
            # (`spotline.train.comms`). The cut never raises (a hung one names the error).
            cut = self.abort_comms(self.attempt)
            self._sticky = sticky_cuda_error(str(e)) or self._sticky
            if self._sticky is not None:  # never kept: the group ends it (`hand_over`)
                msg = "rank %d: sticky CUDA error (%s); its process ends with this group"
                log.error(msg, self.topo.rank, self._sticky)
            if cut.hung is not None and isinstance(e, Exception):
                raise cut.hung.after(e) from e
            raise

    @ray.method(concurrency_group="abort")
    def abort_comms(self, attempt: str) -> Cut:
        """Abort this rank's communicators in group `attempt` (over) now: a collective
        blocked in it or in a peer fails at once (`hand_over` asks each rank it may
        keep). Its own concurrency group: `progress` never waits behind it. Never raises."""
        if self._comms is None or attempt != self.attempt:  # already in a later group
            return Cut()
        cut = self._comms.abort()
        self._hung = cut.hung or self._hung
        return cut

    def _train(self, tr: Trainer, target: int, interval: int, saved_through: int) -> dict[str, Any]:
        while tr.step < target:
            t0 = time.perf_counter()
            if self._steps_run == 1:  # the first steady step: optimizer state exists
                loss, peak = measure_peak(tr.train_step, tr.device)
                with self._lock:
                    self._buf["memory"] = {"stage": self.topo.stage, "peak_bytes": peak}
            else:
                loss = tr.train_step()
            self._steps_run += 1
            step_s = time.perf_counter() - t0
            self._watch_sigterm()
            with self._lock:
                req = dataclasses.replace(self._req)
            ask = req.save_at if req.save_at > saved_through else 0
            busy = self.uploader.saving
            save_at, stop_at, every, behind = tr.agree(ask, req.stop_at, req.peer_every, busy)
            s = tr.step
            stop = 0 < stop_at <= s
            asked = stop or s == target or 0 < save_at <= s
            # A periodic save while some rank still uploads an earlier one is skipped on
            # every rank alike (they agreed on `behind`): host snapshots never pile up.
            # A save that was asked for (a stop, a notice, the last step) always runs.
            save = asked or (s % interval == 0 and not behind)
            if s % interval == 0 and behind and not asked and self.topo.rank == 0:
                with self._lock:
                    self._buf["skipped"].append(s)
            with self._lock:
                self._buf["steps"].append((s, loss, step_s, time.time()))
            self._unsaved_losses.append((s, loss))
            self._recent_losses.append((s, loss))
            if save:
                self._save(s)
                saved_through = s
            elif self._peer_due(s, every):
                self._peer_copy(s)
            if stop:
                tr.heartbeat.phase(f"stopped at step {s}")
                return {"rank": self.topo.rank, "stopped_at": s, "reason": req.reason or "stop"}
        tr.heartbeat.phase(f"reached step {tr.step}")
        return {"rank": self.topo.rank, "stopped_at": tr.step, "reason": "target"}

    def _watch_sigterm(self) -> None:
        notice = self._sigterm.poll() if self._sigterm is not None else None
        if notice is None or self._sigterm_reported:
            return
        self._sigterm_reported = True
        with self._lock:
            self._buf["notices"].append(dataclasses.asdict(notice) | {"rank": self.topo.rank})
            # Save and stop at once: this process has seconds left.
            self._req.save_at = self._req.stop_at = 1
            self._req.reason = f"SIGTERM to rank {self.topo.rank}"

    def _save(self, step: int) -> None:
        """Host copy (the only part that blocks training), then a background upload."""
        assert self.trainer is not None
        self.trainer.heartbeat.phase(f"checkpoint save of step {step} (host copy)")
        t0 = time.perf_counter()
        snap = self.trainer.snapshot()
        blocked = time.perf_counter() - t0
        if self.faults is not None:
            self.faults.maybe_freeze(step, "save")
        local = self.staging / f"step_{step:08d}"
        losses, self._unsaved_losses = self._unsaved_losses, []
        self.uploader.submit(
            step,
            local,
            lambda out: self._write(snap, out),
            snap.meta.get("batch_schedule"),
            losses=losses if self.topo.rank == 0 else [],  # the group reports rank 0's
        )
        with self._lock:
            self._buf["saves"].append((step, blocked, snap.nbytes))

    def _peer_due(self, step: int, every: int) -> bool:
        """A peer copy at `step`: every `every` steps (the same on every rank, agreed);
        `every` -1 asks for one copy right after the group's warm-up steps, to measure
        its cost against the steady steps that follow."""
        if self.uploader.peer is None:
            return False
        if every == -1:
            with self._lock:
                warm = self._steps_run > constants.SPOTLINE_PEER_WARM_STEPS
                if self._req.peer_every == -1 and warm:
                    self._req.peer_every = 0  # measured once: k comes from the controller
                    return True
            return False
        return every > 0 and step % every == 0

    def _peer_copy(self, step: int) -> None:
        """Host copy (blocks training as a save's does), then serialization and the
        send to the keepers on the upload thread; skipped while a save still uploads."""
        assert self.trainer is not None
        if self.uploader.busy:  # the next copy comes k steps later: no host copy for none
            with self._lock:
                self._buf["peer"].append({"step": step, "rank": self.topo.rank, "taken": False})
            return
        self.trainer.heartbeat.phase(f"peer copy of step {step} (host copy)")
        started = time.time()  # the controller prices the copy from here on
        t0 = time.perf_counter()
        snap = self.trainer.snapshot()
        blocked = time.perf_counter() - t0
        local = self.staging / f"peer_{step:08d}"
        taken = self.uploader.submit_peer(
            step,
            local,
            lambda out: self._write(snap, out),
            snap.meta.get("batch_schedule"),
            list(self._recent_losses) if self.topo.rank == 0 else [],
        )
        with self._lock:
            self._buf["peer"].append(
                {
                    "step": step,
                    "rank": self.topo.rank,
                    "blocked_s": blocked,
                    "taken": taken,
                    "started": started,
                }
            )

    def _write(self, snap: Any, out: Path) -> Any:
        try:
            return self.trainer.write(snap, out)
        except OSError as e:
            # Same type (the controller sorts failures by it), with the field to fix.
            raise type(e)(
                e.errno,
                f"rank {self.topo.rank} cannot write under checkpoint.staging_dir {out}: "
                f"{e.strerror or e}; point checkpoint.staging_dir at a writable local disk "
                "with room for a checkpoint",
            ) from e

    def wait_uploads(self, timeout_s: float) -> bool:
        return self.uploader.wait(timeout_s)

    @blames_user_code
    def heldout_loss(self) -> float:
        assert self.trainer is not None
        return self.trainer.heldout_loss()

    # --- published figures ------------------------------------------------------------

    def _export_devices(self) -> None:
        own = self.local_rank if self.device == "gpu" else None  # its one GPU, if any
        export_gpu_samples(self.metrics, self.topo.stage, self.topo.replica, own)
