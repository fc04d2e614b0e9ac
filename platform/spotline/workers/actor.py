"""The Ray actor that hosts one rank: a thin shell over `Trainer`.

Every method is called by the worker group in lock-step on all ranks. Nothing
here talks to the controller on its own; results travel back as return values.

One exception runs beside training: `request_checkpoint` lives in its own
concurrency group ("control"), so the controller can ask a rank mid-chunk to
stop at the next step boundary. A SIGTERM to the process (when the job watches
for it) asks the same. After every step the ranks agree, with one tiny
all-reduce, whether any of them was asked, so they all stop at the same step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

import ray

from spotline import constants
from spotline.bubbles.channel import WindowChannel
from spotline.checkpoint import CheckpointStore, CorruptCheckpointError, Manifest
from spotline.checkpoint.layout import CheckpointFormatError
from spotline.checkpoint.staging import check_local_dir
from spotline.config.redact import install_log_redaction
from spotline.config.schema import JobSpec
from spotline.metrics.export import Metrics, export_gpu_samples
from spotline.metrics.flops import device_peak
from spotline.preemption import make_source
from spotline.workers.cpu import pin_process
from spotline.workers.trainer import Topology, Trainer, init_distributed
from spotline.workers.uploads import Uploader

log = logging.getLogger("spotline.worker")


def channel_path(spec: JobSpec, run_id: str, rank: int) -> str:
    """Where a rank's trainer and backfill executor share their window channel."""
    root = Path(spec.checkpoint.staging_dir) / spec.name / run_id
    return str(root / f"window_rank_{rank:05d}.chan")


class TrainWorker:
    def __init__(self, spec_json: str, topo: Topology, store: CheckpointStore, run_id: str):
        install_log_redaction()
        self.spec = JobSpec.model_validate_json(spec_json)
        self.topo = topo
        self.store = store
        root = Path(self.spec.checkpoint.staging_dir) / self.spec.name / run_id
        self.staging = root / f"rank_{topo.rank:05d}"
        self.restore_dir = Path(self.spec.checkpoint.staging_dir) / self.spec.name / "restore"
        self.trainer: Trainer | None = None
        cap = self.spec.checkpoint.upload_max_mb_per_s
        self.uploader = Uploader(
            store, topo.rank, topo.world_size, None if cap is None else cap * 1e6
        )
        self._stop = threading.Event()
        self.run_id = run_id
        self.channel: WindowChannel | None = None
        self._filled_seen = (0, 0)  # (filled_ns, overrun_ns) already reported
        self._sigterm = None
        self._sigterm_reported = False
        sigterm = [s for s in self.spec.preemption.sources if s.kind == "sigterm"]
        if sigterm:
            # Actor construction runs on the process's main thread, where Python
            # delivers signals; training runs on a worker thread and polls the source.
            node = ray.get_runtime_context().get_node_id()
            self._sigterm = make_source(sigterm[0], node_id=node)
            self._sigterm.install()

    # --- start-up -----------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {
            "rank": self.topo.rank,
            "pid": os.getpid(),
            "node_id": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
        }

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def setup(self, master_addr: str, master_port: int) -> dict[str, Any]:
        if constants.SPOTLINE_PIN_CORES:
            pin_process(self.topo.rank)
        # This node's disk, checked before the first step rather than at the first save.
        check_local_dir(self.staging, "checkpoint.staging_dir")
        backend = init_distributed(self.topo, master_addr, master_port)
        threads = max(1, int(self.spec.resources.cpus_per_worker))
        if self.spec.backfill.enabled:
            self.channel = WindowChannel(
                channel_path(self.spec, self.run_id, self.topo.rank), create=True
            )
        self.trainer = Trainer(self.spec, self.topo, threads=threads, window_channel=self.channel)
        self.metrics = Metrics(self.spec.name)
        name, peak = device_peak(self.spec.parallel.precision, threads)
        return {"backend": backend, "device": name, "peak_flops": peak}

    def fetch_checkpoint(self, manifest_json: str) -> str:
        """Download and verify (sha256) a committed checkpoint; raises CorruptCheckpointError."""
        manifest = Manifest.from_json(manifest_json)
        return str(self.store.download(manifest, self.restore_dir))

    def load_checkpoint(self, local_dir: str, step: int) -> int:
        """Load a verified checkpoint; a file that does not parse is reported as corrupt."""
        assert self.trainer is not None
        try:
            self.trainer.load(Path(local_dir), step)
        except CheckpointFormatError as e:
            try:
                where = Path(e.path).resolve().relative_to(Path(local_dir).resolve()).as_posix()
            except ValueError:
                where = e.path
            raise CorruptCheckpointError(step, where, e.reason, uri=self.store.uri) from None
        return self.trainer.step

    # --- steady state -------------------------------------------------------------

    @ray.method(concurrency_group="control")
    def request_checkpoint(self, reason: str) -> None:
        """Stop the running chunk at the next step boundary (every rank stops there)."""
        log.info("rank %d: asked to stop at the next step boundary (%s)", self.topo.rank, reason)
        self._stop.set()

    def train(self, n_steps: int) -> dict[str, Any]:
        """Up to n_steps steps; fewer when any rank was asked to stop at a boundary."""
        assert self.trainer is not None
        losses: list[tuple[int, float]] = []
        notices: list[dict[str, Any]] = []
        interrupted = False
        self._export_devices()
        t0 = time.perf_counter()
        stall0 = self.trainer.data_stall_s
        for _ in range(n_steps):
            loss = self.trainer.train_step()
            losses.append((self.trainer.step, loss))
            notice = self._sigterm.poll() if self._sigterm is not None else None
            if notice is not None and not self._sigterm_reported:
                self._sigterm_reported = True
                notices.append(dataclasses.asdict(notice) | {"rank": self.topo.rank})
                self._stop.set()
            if self.trainer.any_rank(self._stop.is_set()):
                interrupted = True
                self._stop.clear()
                break
        return {
            "rank": self.topo.rank,
            "losses": losses,
            "seconds": time.perf_counter() - t0,
            "uploads": self.uploader.take_done(),
            "interrupted": interrupted,
            "notices": notices,
            "bubbles": self._bubbles(),
            "lr": self.trainer.lr(),
            "data_stall_s": self.trainer.data_stall_s - stall0,
        }

    def _export_devices(self) -> None:
        export_gpu_samples(self.metrics, self.topo.stage, self.topo.replica)

    def _bubbles(self) -> dict[str, Any] | None:
        """This stage's bubble figures since the last chunk, and its latest step's timeline."""
        rec = self.trainer.recorder if self.trainer else None
        if rec is None:
            return None
        out: dict[str, Any] = rec.take_totals()
        out.update(stage=self.topo.stage, replica=self.topo.replica, rank=self.topo.rank)
        out["filled_s"] = out["overrun_s"] = 0.0
        if self.channel is not None:
            st = self.channel.state()
            out["filled_s"] = (st.filled_ns - self._filled_seen[0]) / 1e9
            out["overrun_s"] = (st.overrun_ns - self._filled_seen[1]) / 1e9
            self._filled_seen = (st.filled_ns, st.overrun_ns)
        out["steps_timeline"] = [
            {
                "step": step,
                "start_ns": int(t0 * 1e9),
                "instrs": [(i.name, i.slot, i.start, i.end) for i in timeline],
            }
            for step, t0, timeline in rec.recent
        ]
        return out

    def save(self) -> dict[str, Any]:
        """Local save (the only part that blocks training), then a background upload."""
        assert self.trainer is not None
        step = self.trainer.step
        local = self.staging / f"step_{step:08d}"
        shutil.rmtree(local, ignore_errors=True)
        t0 = time.perf_counter()
        try:
            self.trainer.save(local)
        except OSError as e:
            # Same type (the controller sorts failures by it), with the field to fix.
            raise type(e)(
                e.errno,
                f"rank {self.topo.rank} cannot save under checkpoint.staging_dir {local}: "
                f"{e.strerror or e}; point checkpoint.staging_dir at a writable local disk "
                "with room for a checkpoint",
            ) from e
        blocked = time.perf_counter() - t0
        self.uploader.submit(step, local)
        return {"rank": self.topo.rank, "step": step, "blocked_s": blocked}

    def flush_uploads(self) -> list:
        return self.uploader.flush(constants.SPOTLINE_UPLOAD_FLUSH_TIMEOUT_S)

    def heldout_loss(self) -> float:
        assert self.trainer is not None
        return self.trainer.heldout_loss()
