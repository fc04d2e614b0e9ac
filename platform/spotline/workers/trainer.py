"""One rank of a Spotline job: a DeepSpeed engine plus its data, save and load.

This is plain Python with no Ray in it, so the same code runs inside a Ray
worker actor and under `torch.multiprocessing` (benchmarks/overhead.py): the
overhead benchmark then measures Spotline's orchestration, nothing else.

The training step must never wait on storage: `save()` writes to node-local
staging and returns; uploads happen on a background thread (see uploads.py).
"""

from __future__ import annotations

import logging
import math
import os
import random
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from spotline import constants
from spotline.bubbles.channel import WindowChannel
from spotline.bubbles.recorder import StepRecorder
from spotline.checkpoint.layout import CheckpointFormatError, load_json, save_json
from spotline.config.schema import JobSpec
from spotline.data import Prefetcher, Sampler, open_dataset
from spotline.models import build_pipeline_module, build_sequential, init_from_hf, model_def
from spotline.workers import portable

RANK_STATE_DIR = "spotline"  # stage state and per-rank RNG state of a step


@dataclass(frozen=True)
class Topology:
    """Where this rank sits. Rank = stage * replicas + replica (DeepSpeed's pipe-major grid)."""

    pipeline_stages: int
    replicas: int
    rank: int

    @property
    def world_size(self) -> int:
        return self.pipeline_stages * self.replicas

    @property
    def stage(self) -> int:
        return self.rank // self.replicas

    @property
    def replica(self) -> int:
        return self.rank % self.replicas


def lr_lambda(spec: JobSpec, replicas: int):
    """Warm-up then cosine, times the batch policy's lr scale at this replica count."""
    t = spec.train
    scale = spec.lr_scale(replicas)

    def f(step: int) -> float:
        if t.warmup_steps and step < t.warmup_steps:
            return scale * (step + 1) / t.warmup_steps
        span = max(1, t.steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / span)
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return scale * (t.min_lr_ratio + (1 - t.min_lr_ratio) * cosine)

    return f


def build_optimizer(model: torch.nn.Module, spec: JobSpec) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": spec.train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # torch's AdamW: DeepSpeed's fused Adam would JIT-compile a C++ op on CPU.
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=spec.train.lr, betas=(0.9, 0.95), eps=1e-8
    )


def init_distributed(topo: Topology, master_addr: str, master_port: int) -> str:
    import deepspeed

    os.environ.update(
        RANK=str(topo.rank),
        WORLD_SIZE=str(topo.world_size),
        LOCAL_RANK="0",
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(
        dist_backend=backend,
        auto_mpi_discovery=False,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=topo.rank,
        world_size=topo.world_size,
        timeout=timedelta(seconds=constants.SPOTLINE_DIST_TIMEOUT_S),
    )
    return backend


class Trainer:
    """Builds the engine for one rank and runs steps, saves and loads."""

    def __init__(
        self,
        spec: JobSpec,
        topo: Topology,
        threads: int | None = None,
        window_channel: WindowChannel | None = None,
    ):
        import deepspeed

        self.spec = spec
        self.topo = topo
        if threads:
            torch.set_num_threads(threads)
        _quiet_deepspeed()
        t = spec.train
        self.pipelined = spec.parallel.pipeline_stages > 1
        # Middle pipeline stages take activations, not tokens: they never read the data.
        self.reads_data = not self.pipelined or topo.stage in (0, topo.pipeline_stages - 1)
        mbs = spec.micro_batch_size()
        self.sampler = self.heldout = None
        if self.reads_data:
            data = open_dataset(spec)
            self.sampler = Sampler(data.train, spec.model.seq_len, mbs, spec.data.seed)
            self.heldout = Sampler(data.heldout, spec.model.seq_len, mbs, spec.data.seed + 1)
        # Batch k is a pure function of (seed, k): building it ahead changes nothing.
        self.prefetch = Prefetcher(lambda k: self._batches(self.sampler, k), spec.data.prefetch)
        self.data_stall_s = 0.0  # seconds steps waited for their batches
        self.model_def = model_def(spec)
        if self.pipelined:
            model = build_pipeline_module(self.model_def, spec.parallel.pipeline_stages)
        else:
            model = build_sequential(self.model_def)
        if getattr(spec.model, "init_from", None):
            init_from_hf(model, spec)  # before DeepSpeed copies the weights into its state
        opt = build_optimizer(model, spec)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(spec, topo.replicas))
        self.engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=opt,
            lr_scheduler=sched,
            config=spec.deepspeed_config(topo.replicas),
            dist_init_required=False,
        )
        self.device = self.engine.device
        self.micro_batches = spec.grad_accum(topo.replicas)
        # Control messages (stop at this step boundary?) go over gloo on the host, so
        # they never queue behind, or synchronise with, the device's compute stream.
        self._control = dist.new_group(backend="gloo")
        # Every pipeline stage times its instructions: that is where its bubbles are
        # measured, and the backfill executor (if any) learns when a window opens.
        self.recorder: StepRecorder | None = None
        if self.pipelined:
            self.recorder = StepRecorder(
                topo.stage,
                topo.pipeline_stages,
                self.micro_batches,
                channel=window_channel,
                min_window_s=constants.SPOTLINE_BACKFILL_MIN_WINDOW_S,
            )
            self.recorder.attach(self.engine)
        _seed_everything(t.seed + topo.rank)
        self.step = 0  # optimizer steps done

    # --- training -----------------------------------------------------------------

    def _batches(self, sampler: Sampler | None, step: int) -> list:
        """This rank's micro-batches of `step`, on the host (None where none are read)."""
        if sampler is None:
            return [None] * self.micro_batches
        return sampler.micro_batches(
            step, self.topo.replica, self.topo.replicas, self.micro_batches
        )

    def _to_device(self, batches: list) -> list:
        return [b if b is None else (b[0].to(self.device), b[1].to(self.device)) for b in batches]

    def train_step(self) -> float:
        """One optimizer step; returns the global-batch mean loss (same on every rank)."""
        host, stall = self.prefetch.get(self.step)
        self.data_stall_s += stall
        batches = self._to_device(host)
        if self.recorder is not None:
            self.recorder.begin_step(self.step + 1)
        if self.pipelined:
            loss = self.engine.train_batch(data_iter=iter(batches)).item()
        else:
            total = torch.zeros((), device=self.device)
            for x, y in batches:
                micro_loss = self.model_def.loss(self.engine(x), y)
                self.engine.backward(micro_loss)
                self.engine.step()
                total += micro_loss.detach()
            loss = self._dp_mean(total / len(batches))
        self.step += 1
        return loss

    def lr(self) -> float | None:
        groups = self.engine.optimizer.param_groups if self.engine.optimizer else []
        return float(groups[0]["lr"]) if groups else None

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if `flag` is True on any rank. Collective: all ranks call it.

        One 4-byte all-reduce per step; it is how every rank agrees to stop at the same
        step boundary, whichever rank (or the controller, through any rank) asked.
        """
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)

        def agree() -> None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._control)

        if self.recorder is not None:
            # Stages that finished the step early wait here: part of their bubble.
            self.recorder.record_sync(agree)
        else:
            agree()
        return bool(t.item())

    def _dp_mean(self, value: torch.Tensor) -> float:
        if self.topo.replicas > 1:
            dist.all_reduce(value)
            value = value / self.topo.replicas
        return float(value.item())

    @torch.no_grad()
    def heldout_loss(self, n_batches: int | None = None) -> float:
        """Mean loss over the first n fixed held-out batches (the same every call)."""
        n = n_batches or self.spec.train.eval_batches
        losses = []
        for k in range(n):
            batches = self._to_device(self._batches(self.heldout, k))
            if self.pipelined:
                out = self.engine.eval_batch(data_iter=iter(batches))
                losses.append(float(out.item()))
            else:
                self.engine.eval()
                loss = self.model_def.loss
                total = sum(loss(self.engine(x), y) for x, y in batches) / len(batches)
                self.engine.train()
                losses.append(self._dp_mean(total))
        return float(np.mean(losses))

    # --- checkpoints --------------------------------------------------------------

    def save(self, staging_root: Path) -> Path:
        """Save this rank's share of the current step under staging_root; returns the dir.

        Each rank writes to its own directory (no two ranks ever write the same path,
        even when they share a node). The union of all ranks' files is one checkpoint:
        one stage file per pipeline stage (full fp32 weights and Adam moments, written by
        the stage's replica 0) and one JSON file of RNG state per rank.
        """
        out = Path(staging_root) / f"global_step{self.step}" / RANK_STATE_DIR
        out.mkdir(parents=True, exist_ok=True)
        # Collective over each stage's replicas; replica 0 writes the stage's file.
        state = portable.gather(self.engine)
        if self.topo.replica == 0:
            portable.save(state, out / f"stage_{self.topo.stage:03d}{portable.STAGE_SUFFIX}")
        save_json(
            out / f"rank_{self.topo.rank:05d}.json",
            {
                "rng": _rng_state(),
                "step": self.step,
                "sampler": {"next_step": self.step, "seed": self.spec.data.seed},
                "topology": {
                    "pipeline_stages": self.topo.pipeline_stages,
                    "replicas": self.topo.replicas,
                },
            },
        )
        return Path(staging_root)

    def load(self, local_dir: Path, step: int) -> None:
        """Load a checkpoint written at any replica count (the stage files are full
        tensors); per-rank RNG state comes back when the replica count is the same."""
        own = Path(local_dir) / f"global_step{step}" / RANK_STATE_DIR
        files = sorted(own.glob(f"stage_*{portable.STAGE_SUFFIX}"))
        if len(files) != self.topo.pipeline_stages:
            raise CheckpointFormatError(
                own,
                f"checkpoint step {step} has {len(files)} stage state file(s), this job has "
                f"{self.topo.pipeline_stages} stage(s)",
            )
        portable.load(self.engine, portable.load_files(files))
        self.step = step
        rank_file = own / f"rank_{self.topo.rank:05d}.json"
        saved = load_json(rank_file) if rank_file.exists() else None
        if saved is not None and saved.get("topology", {}).get("replicas") == self.topo.replicas:
            _set_rng_state(saved["rng"])
        else:
            # Per-rank RNG streams do not map across sizes: reseed from (seed, rank, step).
            _seed_everything(self.spec.train.seed + 7919 * step + self.topo.rank)
        self._sync_lr()

    def _sync_lr(self) -> None:
        """Set the optimizer's lr from this group's schedule at the loaded step.

        The loaded optimizer carries the lr of the group that saved it; under the scaled
        batch policy a group of another size trains with another lr from its first step.
        """
        sched = self.engine.lr_scheduler
        if sched is None:
            return
        for group, base, fn in zip(
            sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True
        ):
            group["lr"] = base * fn(sched.last_epoch)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _rng_state() -> dict[str, Any]:
    """Every RNG a rank draws from, as JSON-able values (a checkpoint holds no pickles)."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(mt), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def _quiet_deepspeed() -> None:
    # DeepSpeed logs every config key at INFO on every rank; keep warnings and errors.
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    try:
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)
    except ImportError:
        pass
