"""What each layer of a model costs: forward + backward of one micro-batch, timed.

The balanced stage partition cuts the layer list by these seconds. Layers are built
and timed one at a time (at most one layer's weights and gradients are held), each on
the activations the layers before it produced, the last one with the loss, as its
pipeline stage runs it. Nothing here touches a checkpoint or a process group.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from spotline.config.schema import JobSpec
from spotline.models import ModelDef, model_def


def layer_costs(
    model: ModelDef,
    micro_batch_size: int,
    device: str | torch.device = "cpu",
    repeats: int = 5,
    threads: int | None = None,
    micro_batches: int = 1,
    optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
) -> list[float]:
    """Seconds each layer costs one training step: `micro_batches` x its forward +
    backward of one micro-batch, plus one step of `optimizer` (built on the layer alone)
    over its parameters. Each part is the best of `repeats` timed runs after one warm-up
    (the fastest is the least disturbed)."""
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    prev_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    # Layers seed their own initialisation; keep the caller's RNG streams as they were.
    rng = torch.get_rng_state()
    try:
        gen = torch.Generator().manual_seed(0)
        shape = (micro_batch_size, model.seq_len)
        x: torch.Tensor = torch.randint(0, model.vocab_size, shape, generator=gen).to(device)
        labels = torch.randint(0, model.vocab_size, shape, generator=gen).to(device)
        costs = []
        last = len(model.layers) - 1
        for i, ld in enumerate(model.layers):
            layer = ld.build().to(device).train()
            opt = optimizer(layer) if optimizer is not None else None
            best = best_opt = float("inf")
            for k in range(repeats + 1):
                inp = x.detach().requires_grad_(x.is_floating_point())
                sync()
                t0 = time.perf_counter()
                out = layer(inp)
                loss = model.loss(out, labels) if i == last else out.float().sum()
                loss.backward()
                sync()
                if k:  # the first run warms up kernels and allocations
                    best = min(best, time.perf_counter() - t0)
                if opt is not None and any(p.grad is not None for p in layer.parameters()):
                    t0 = time.perf_counter()
                    opt.step()
                    sync()
                    if k:
                        best_opt = min(best_opt, time.perf_counter() - t0)
                    opt.zero_grad(set_to_none=False)
            costs.append(micro_batches * best + (best_opt if best_opt < float("inf") else 0.0))
            x = out.detach()
            del layer, out, loss
    finally:
        torch.set_rng_state(rng)
        if threads is not None:
            torch.set_num_threads(prev_threads)
    return costs


def probe(
    spec: JobSpec, rank: int, threads: int, layers: bool, replicas: int | None = None
) -> dict[str, Any]:
    """One worker's figures for the balanced partition: `flops`, a matmul's FLOP/s at its
    thread budget on its device (the MFU probe's measurement); `memory_bytes`, its GPU's
    memory (None on CPU); and with `layers`, `layer_s`: each layer's cost on this worker
    of one training step at `replicas` (its micro-batches and the job's optimizer step,
    see `layer_costs`)."""
    from spotline.metrics.mfu import measure_matmul_flops
    from spotline.train.trainer import build_optimizer

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    spec = spec.on_device("gpu" if gpu else "cpu")
    dtype = torch.bfloat16 if spec.parallel.precision == "bf16" else torch.float32
    n = 4096 if gpu else 512
    out: dict[str, Any] = {
        "rank": rank,
        "flops": measure_matmul_flops(dtype, n=n, repeats=5, threads=threads, device=device),
        "memory_bytes": torch.cuda.get_device_properties(0).total_memory if gpu else None,
    }
    if layers:
        out["layer_s"] = layer_costs(
            model_def(spec),
            spec.micro_batch_size(),
            device,
            threads=threads,
            micro_batches=spec.grad_accum(replicas or spec.replica_counts()[0]),
            optimizer=lambda layer: build_optimizer(layer, spec, device="gpu" if gpu else "cpu"),
        )
    return out
