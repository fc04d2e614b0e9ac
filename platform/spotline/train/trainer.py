"""One rank of a Spotline job: a DeepSpeed engine plus its data, save and load.

This is plain Python with no Ray in it, so the same code runs inside a Ray
worker actor and under `torch.multiprocessing` (benchmarks/overhead.py): the
overhead benchmark then measures Spotline's orchestration, nothing else.

The training step never waits on storage: `snapshot()` copies this rank's share
to the host and returns; serialization and upload happen on a background thread
(`spotline.checkpoint.transfer`), and the format is `spotline.checkpoint.layout`'s.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from spotline import constants
from spotline.bubbles.channel import WindowChannel
from spotline.bubbles.recorder import StepRecorder
from spotline.checkpoint.layout import RankFiles, write_rank
from spotline.checkpoint.reshard import checkpoint_meta
from spotline.config.schema import JobSpec
from spotline.data import Prefetcher, Sampler, open_dataset
from spotline.metrics.mfu import device_peak
from spotline.models import (
    BuildOptions,
    build_pipeline_module,
    build_sequential,
    init_from_hf,
    model_def,
)
from spotline.planning.partition import stage_bounds
from spotline.planning.step import stage_micro_s
from spotline.train import state
from spotline.train.adaptive import BatchSchedule, GradProbe, grow_to
from spotline.train.ds_config import deepspeed_config
from spotline.train.health import ComputeMeter, Heartbeat
from spotline.train.process import Topology, training_device


@dataclass(frozen=True)
class Fetched:
    """A checkpoint this rank has read and loaded into its engine (see Trainer.fetch)."""

    step: int
    rank_meta: dict[str, Any] | None
    meta: dict[str, Any]
    bytes_read: int


def lr_lambda(spec: JobSpec, replicas: int, batch_scale=lambda: 1.0):
    """Warm-up then cosine, times the batch policy's lr scale at this replica count and
    the adaptive schedule's (`batch_scale()`, read at every step)."""
    t = spec.train
    policy = spec.lr_scale(replicas)

    def f(step: int) -> float:
        scale = policy * batch_scale()
        if t.warmup_steps and step < t.warmup_steps:
            return scale * (step + 1) / t.warmup_steps
        span = max(1, t.steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / span)
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return scale * (t.min_lr_ratio + (1 - t.min_lr_ratio) * cosine)

    return f


def build_optimizer(
    model: torch.nn.Module, spec: JobSpec, *, device: str = "cpu"
) -> torch.optim.Optimizer:
    """The job's AdamW over `model`'s trainable parameters (no weight decay on 1-D ones).

    `device`: where the parameters will train ('gpu' or 'cpu'). On a GPU the update is
    torch's fused kernel (one launch per step, not several per parameter)."""
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
        [g for g in groups if g["params"]],
        lr=spec.train.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True if device == "gpu" else None,
    )


class Trainer:
    """Builds the engine for one rank and runs steps, saves and loads."""

    def __init__(
        self,
        spec: JobSpec,
        topo: Topology,
        threads: int | None = None,
        window_channel: WindowChannel | None = None,
        bounds: list[int] | None = None,
        flops_per_s: float | None = None,
        init: bool = True,
        engine_hook: Callable[[Any, Callable[[], int]], None] | None = None,
    ):
        """`flops_per_s`: this device's FLOP/s (`metrics.mfu.device_peak`, looked up
        here when not given), from which a pipeline stage predicts its bubbles before
        it has measured a step. `init=False`: the caller loads a checkpoint (`fetch`,
        `load`) before the first step, so the stage is materialised empty, never
        randomly initialised; a step before that load refuses to run. `engine_hook`:
        called with the engine and a function returning the step being trained, before
        anything times the engine's passes (the injected faults of tests)."""
        import deepspeed

        device = training_device()
        spec = spec.on_device(device)
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
        # The layers each stage holds (layer-index bounds); recorded with every save.
        self.bounds = bounds or stage_bounds(self.model_def, spec.parallel.pipeline_stages)
        # A resume's checkpoint, else model.init_from, else the random init: each layer
        # of this rank's stage is built once, on the meta device, and then initialised
        # in place, or left empty for the weights a load writes.
        init_from = getattr(spec.model, "init_from", None) if init else None
        opts = BuildOptions(
            init=init and not init_from,
            recompute_every=spec.parallel.activation_checkpointing,
            compile=spec.parallel.compile,
        )
        self._weights_set = init
        if self.pipelined:
            model = build_pipeline_module(
                self.model_def, spec.parallel.pipeline_stages, self.bounds, opts
            )
        elif spec.parallel.zero_stage == 3 and not init_from and self._inits_in_place():
            model = self._build_split(deepspeed, opts)
        else:
            model = build_sequential(self.model_def, opts)
        if init_from:
            init_from_hf(model, spec)  # before DeepSpeed copies the weights into its state
        opt = build_optimizer(model, spec, device=device)
        self.adaptive = t.batch_schedule == "adaptive"
        self.schedule = BatchSchedule.start(
            spec.global_batch(topo.replicas), t.batch_schedule, t.adaptive.ema_decay
        )
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lr_lambda(spec, topo.replicas, lambda: self.schedule.lr_scale())
        )
        self.engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=opt,
            lr_scheduler=sched,
            config=deepspeed_config(
                spec, topo.replicas, sum(p.numel() for p in model.parameters())
            ),
            dist_init_required=False,
        )
        self.device = self.engine.device
        if engine_hook is not None:
            engine_hook(self.engine, lambda: self.step + 1)
        self.micro_batches = spec.grad_accum(topo.replicas)
        # Control messages (stop at this step boundary?) go over gloo on the host, so
        # they never queue behind, or synchronise with, the device's compute stream.
        self._control = dist.new_group(backend="gloo")
        # Every pipeline stage times its instructions: that is where its bubbles are
        # measured, and the backfill executor (if any) learns when a window opens.
        self.recorder: StepRecorder | None = None
        # What this rank is doing, and its own compute per step (hang and straggler
        # watch); a pipeline's compute is its recorder's forward and backward.
        self.heartbeat = Heartbeat()
        self.compute = None if self.pipelined else ComputeMeter(self.device)
        if self.pipelined:
            rate = flops_per_s or device_peak(spec.parallel.precision, threads)[1]
            self.recorder = StepRecorder(
                topo.stage,
                topo.pipeline_stages,
                self.micro_batches,
                channel=window_channel,
                min_window_s=constants.SPOTLINE_BACKFILL_MIN_WINDOW_S,
                # Until a step is measured, the windows come from the simulated schedule.
                micro_s=stage_micro_s(spec, rate, self.bounds, self.model_def) if rate else None,
                on_instruction=self.heartbeat.instruction,
            )
            self.recorder.attach(self.engine)
        # The adaptive schedule's reading of each step's first micro-batch gradient.
        self.probe = GradProbe(self.engine.module) if self.adaptive else None
        self._proposal = 0  # global batch this rank proposes at this step boundary (0: none)
        _seed_everything(t.seed + topo.rank)
        self.step = 0  # optimizer steps done

    def _inits_in_place(self) -> bool:
        """Whether every layer class initialises itself through `init_weights` (which
        can run on a layer gathered after the build), as the built-in ones do."""
        return all(hasattr(ld.cls, "init_weights") for ld in self.model_def.layers)

    def _build_split(self, deepspeed: ModuleType, opts: BuildOptions) -> torch.nn.Module:
        """ZeRO-3 at pp=1: DeepSpeed's `zero.Init` splits each layer's parameters over the
        replicas as soon as the layer is built, so no rank ever holds the whole model.
        Each layer is then gathered whole, one at a time, for its `init_weights` (on
        every rank, from the layer's seed; rank 0's values are kept), unless the
        weights come from the checkpoint this group restores next."""
        with deepspeed.zero.Init(
            config_dict_or_path=deepspeed_config(self.spec, self.topo.replicas)
        ):
            model = build_sequential(self.model_def, replace(opts, init=False, meta=False))
        if opts.init:
            for layer in model:
                params = list(layer.parameters())
                with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                    layer.init_weights()
        return model

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
        if not self._weights_set:
            raise RuntimeError(
                f"rank {self.topo.rank} was built to load a checkpoint (its weights are "
                "empty) and none was loaded before its first step; this is a Spotline "
                "bug, and the restart that follows initialises the weights"
            )
        beat = self.heartbeat
        beat.begin_step(self.step + 1)
        host, stall = self.prefetch.get(self.step)
        if len(host) != self.micro_batches:  # built ahead before the batch changed
            host = self._batches(self.sampler, self.step)
        self.data_stall_s += stall
        batches = self._to_device(host)
        if self.recorder is not None:
            self.recorder.begin_step(self.step + 1)
        if self.probe is not None:
            self.probe.arm()
        if self.pipelined:
            loss = self.engine.train_batch(data_iter=iter(batches)).item()
        else:
            total = torch.zeros((), device=self.device)
            last = len(batches) - 1
            meter = self.compute
            assert meter is not None
            meter.begin_step()
            for i, (x, y) in enumerate(batches):
                # The boundary is explicit: the engine's own count of micro-steps would
                # misplace it after the number of micro-batches per step changes.
                self.engine.set_gradient_accumulation_boundary(i == last)
                beat.phase(f"forward micro-batch {i + 1}")
                mark = meter.start()
                out = self.engine(x)
                meter.stop(mark)
                micro_loss = self.model_def.loss(out, y)
                beat.phase(
                    f"backward micro-batch {i + 1}"
                    + (" and gradient reduction (collective)" if i == last else "")
                )
                self.engine.backward(micro_loss)
                if i == last:
                    beat.phase("optimizer step")
                self.engine.step()
                total += micro_loss.detach()
            meter.end_step()
            beat.phase("loss all-reduce (collective)")
            loss = self._dp_mean(total / len(batches))
        self.step += 1
        if self.probe is not None:
            self._observe_noise()
        return loss

    # --- the adaptive batch -------------------------------------------------------

    def _observe_noise(self) -> None:
        """Fold this step's two gradient norms into the noise scale (one 8-byte
        all-reduce on the host group: every rank then holds the same averages), and at
        a checkpoint boundary propose the next batch (agreed on in `agree`)."""
        assert self.probe is not None
        gas = self.micro_batches
        # Every rank holds its stage's part of its replica's first micro-batch gradient,
        # scaled by 1/gas: the sum over all ranks / replicas is the mean full-model
        # squared norm of one micro-batch, over the replicas.
        small = torch.tensor([self.probe.take()], dtype=torch.float64)
        dist.all_reduce(small, group=self._control)
        small_sq = float(small[0]) * gas * gas / self.topo.replicas
        big = self.engine.get_global_grad_norm()
        big_sq = float(big) ** 2 if big is not None else math.nan
        self.schedule.noise.update(
            small_sq, self.spec.micro_batch_size(), big_sq, self.schedule.batch
        )
        self._proposal = 0
        interval = self.spec.checkpoint.interval_steps
        if self.step % interval == 0 and self.step < self.spec.train.steps:
            lo, hi = self.spec.batch_bounds()
            est = self.schedule.noise.estimate()
            self.schedule.estimates.append([self.step, est if est is not None else -1.0])
            self._proposal = grow_to(self.schedule.batch, est, self.spec.batch_unit(), lo, hi)

    def noise_scale(self) -> float | None:
        """The current B_simple estimate (sequences), or None."""
        return self.schedule.noise.estimate() if self.adaptive else None

    def batch_info(self) -> dict[str, Any]:
        """The batch in force, as progress reports publish it."""
        return {
            "schedule": self.schedule.schedule,
            "global_batch_size": self.schedule.batch,
            "micro_batches": self.micro_batches,
            "noise_scale": self.noise_scale(),
            "history": [list(h) for h in self.schedule.history],
        }

    def _set_batch(self, batch: int) -> None:
        """Train from the next step on with a global batch of `batch`: the engine's
        gradient accumulation, the pipeline schedule, the lr (square-root rule)."""
        self.schedule.set_from(self.step + 1, batch)
        self._apply_batch()

    def _apply_batch(self) -> None:
        batch = self.schedule.batch
        self.micro_batches = self.spec.micro_batches_for(batch, self.topo.replicas)
        if self.engine.train_batch_size() != batch:
            self.engine.set_train_batch_size(batch)
        if self.recorder is not None:
            self.recorder.set_micro_batches(self.micro_batches)
        self._sync_lr()

    def lr(self) -> float | None:
        groups = self.engine.optimizer.param_groups if self.engine.optimizer else []
        return float(groups[0]["lr"]) if groups else None

    def agree(
        self, save_at: int, stop_at: int, peer_every: int = 0, busy: bool = False
    ) -> tuple[int, int, int, bool]:
        """The largest (save_at, stop_at, peer_every) any rank holds, and whether any
        rank's upload thread is `busy`, on every rank. Collective: all ranks call it
        after every step.

        One small all-reduce per step; it is how every rank agrees to save or stop at
        the same step boundary, whichever rank (or the controller, through any rank) asked,
        and to which global batch an adaptive schedule grows at a checkpoint boundary.
        """
        t = torch.tensor(
            [save_at, stop_at, self._proposal, peer_every, int(busy)], dtype=torch.int64
        )

        def agree() -> None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._control)

        if self.recorder is not None:
            # Stages that finished the step early wait here: part of their bubble.
            self.recorder.record_sync(agree)
        else:
            self.heartbeat.phase("step agreement (collective)")
            agree()
        self._proposal = 0
        if int(t[2]) > 0:
            # The adaptive batch of the next steps rides on the same all-reduce, so
            # every rank changes at the same boundary to the same size.
            self._set_batch(int(t[2]))
        return int(t[0]), int(t[1]), int(t[3]), bool(t[4])

    def _dp_mean(self, value: torch.Tensor) -> float:
        if self.topo.replicas > 1:
            dist.all_reduce(value)
            value = value / self.topo.replicas
        return float(value.item())

    @torch.no_grad()
    def heldout_loss(self, n_batches: int | None = None) -> float:
        """Mean loss over the first n fixed held-out batches (the same every call)."""
        n = n_batches or self.spec.train.eval_batches
        # The held-out set does not follow an adaptive batch: the starting batch's shape.
        micro = self.spec.grad_accum(self.topo.replicas)
        losses = []
        for k in range(n):
            host = [None] * micro
            if self.heldout is not None:
                host = self.heldout.micro_batches(k, self.topo.replica, self.topo.replicas, micro)
            batches = self._to_device(host)
            if self.pipelined:
                out = self.engine.eval_batch(data_iter=iter(batches), num_micro_batches=micro)
                losses.append(float(out.item()))
            else:
                self.engine.eval()
                loss = self.model_def.loss
                total = sum(loss(self.engine(x), y) for x, y in batches) / len(batches)
                self.engine.train()
                losses.append(self._dp_mean(total))
        return float(np.mean(losses))

    # --- checkpoints --------------------------------------------------------------

    def close(self) -> None:
        """Stop building batches ahead; the engine goes with the last reference to this
        trainer (a rank that re-forms in its own process drops it, then leaves the
        process group: `spotline.train.process.leave_distributed`)."""
        self.prefetch.close()

    def snapshot(self) -> state.RankSnapshot:
        """Host copies of what this rank owns (the only part of a save that blocks
        training; no collective): its ZeRO share of the fp32 weights and Adam moments,
        its stage's module weights on replica 0, and its RNG state."""
        snap = state.snapshot(self.engine, self.topo, write_weights=self.topo.replica == 0)
        snap.meta.update(
            rng=_rng_state(),
            step=self.step,
            sampler={"next_step": self.step, "seed": self.spec.data.seed},
            batch_schedule=self.schedule.to_dict() if self.adaptive else None,
            partition=list(self.bounds),
        )
        return snap

    @staticmethod
    def write(snap: state.RankSnapshot, out: Path) -> RankFiles:
        """Serialize a snapshot into `out` (safetensors + JSON): its index entries, with
        files relative to `out`, and each file's size and sha256 as written (the upload
        does not hash them again). Runs on the upload thread."""
        return write_rank(snap, out, root=out)

    def fetch(self, manifest: Any, store: Any) -> Fetched:
        """Read, verify and load just what this rank holds of a committed checkpoint
        written at any shape (ranged reads; no collective). The engine is changed only
        once every byte this rank needs has verified."""
        index = manifest.extra.get("index")
        # This rank's own meta file (its RNG states) matters only at the saved shape.
        topo = manifest.topology
        same = (topo.get("replicas"), topo.get("pipeline_stages")) == (
            self.topo.replicas,
            self.topo.pipeline_stages,
        )
        meta, mine = checkpoint_meta(manifest, store, self.topo.rank if same else None)
        stats = state.load(
            self.engine, self.topo, index, meta, state.store_reader(store, manifest.step)
        )
        return Fetched(manifest.step, mine, meta, stats["bytes_read"])

    def load(self, fetched: Fetched) -> None:
        """Finish a load: the step, RNG streams (the same ones when this rank existed at
        the saved shape; reseeded otherwise) and the lr of this group's schedule."""
        self.step = fetched.step
        self._weights_set = True
        own = fetched.rank_meta
        topo = own.get("topology", {}) if own else {}
        same = (
            topo.get("replicas") == self.topo.replicas
            and topo.get("pipeline_stages") == self.topo.pipeline_stages
        )
        if own is not None and same and "rng" in own:
            _set_rng_state(own["rng"])
        else:
            # Per-rank RNG streams do not map across shapes: reseed from (seed, rank, step).
            _seed_everything(self.spec.train.seed + 7919 * fetched.step + self.topo.rank)
        saved = fetched.meta.get("batch_schedule")
        if self.adaptive and saved:
            # The batch in force, and the averages the next boundary decides from.
            self.schedule = BatchSchedule.from_dict(saved)
        self._apply_batch()

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
