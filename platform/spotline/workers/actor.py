"""The Ray actor that hosts one rank: a thin shell over `Trainer`.

Every method is called by the worker group in lock-step on all ranks. Nothing
here talks to the controller on its own; results travel back as return values.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from spotline import constants
from spotline.checkpoint import CheckpointStore, Manifest
from spotline.spec.models import JobSpec
from spotline.workers.trainer import Topology, Trainer, init_distributed
from spotline.workers.uploads import Uploader


class TrainWorker:
    def __init__(self, spec_json: str, topo: Topology, store: CheckpointStore, run_id: str):
        self.spec = JobSpec.model_validate_json(spec_json)
        self.topo = topo
        self.store = store
        root = Path(self.spec.checkpoint.staging_dir) / self.spec.name / run_id
        self.staging = root / f"rank_{topo.rank:05d}"
        self.restore_dir = Path(self.spec.checkpoint.staging_dir) / self.spec.name / "restore"
        self.trainer: Trainer | None = None
        self.uploader = Uploader(store, topo.rank, topo.world_size)

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

    def setup(self, master_addr: str, master_port: int) -> str:
        backend = init_distributed(self.topo, master_addr, master_port)
        threads = max(1, int(self.spec.resources.cpus_per_worker))
        self.trainer = Trainer(self.spec, self.topo, threads=threads)
        return backend

    def fetch_checkpoint(self, manifest_json: str) -> str:
        """Download and verify (sha256) a committed checkpoint; raises CorruptCheckpointError."""
        manifest = Manifest.from_json(manifest_json)
        return str(self.store.download(manifest, self.restore_dir))

    def load_checkpoint(self, local_dir: str, step: int, reshard: bool) -> int:
        assert self.trainer is not None
        self.trainer.load(Path(local_dir), step, reshard)
        return self.trainer.step

    # --- steady state -------------------------------------------------------------

    def train(self, n_steps: int) -> dict[str, Any]:
        assert self.trainer is not None
        losses: list[tuple[int, float]] = []
        t0 = time.perf_counter()
        for _ in range(n_steps):
            loss = self.trainer.train_step()
            losses.append((self.trainer.step, loss))
        return {
            "rank": self.topo.rank,
            "losses": losses,
            "seconds": time.perf_counter() - t0,
            "uploads": self.uploader.take_done(),
        }

    def save(self) -> dict[str, Any]:
        """Local save (the only part that blocks training), then a background upload."""
        assert self.trainer is not None
        step = self.trainer.step
        local = self.staging / f"step_{step:08d}"
        shutil.rmtree(local, ignore_errors=True)
        t0 = time.perf_counter()
        self.trainer.save(local)
        blocked = time.perf_counter() - t0
        self.uploader.submit(step, local)
        return {"rank": self.topo.rank, "step": step, "blocked_s": blocked}

    def flush_uploads(self) -> list:
        return self.uploader.flush(constants.SPOTLINE_UPLOAD_FLUSH_TIMEOUT_S)

    def heldout_loss(self) -> float:
        assert self.trainer is not None
        return self.trainer.heldout_loss()
