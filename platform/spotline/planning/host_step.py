"""One training step on this host's CPUs, from what its parts take here rather than from
a peak rate: the step time `spotline plan` and a run's "plan vs run" both report for a
CPU job.

A CPU job's step is not its FLOPs at a matmul's rate: its matrices are small, and much
of a step is per-operation work (autograd, normalisations, the loss) that no FLOP
count sees. So the parts are measured, once per shape, on this host:

- each stage's forward and backward of one micro-batch, its own layers run on the
  model's real shapes with the rank's threads (resources.cpus_per_worker);
- the optimizer step over the rank's ZeRO share of its stage.

The step is then the 1F1B schedule of those passes (`bubbles.schedule`), each pass
plus `SPOTLINE_PIPE_PASS_OVERHEAD_S` (DeepSpeed's pipeline instruction, the activation
or gradient sent over gloo, which this host measurement cannot run), then the optimizer
step, plus `SPOTLINE_STEP_OVERHEAD_S` (the gradient all-reduce, DeepSpeed's step
bookkeeping); both are constants measured on a CPU node (benchmarks/README.md, "Step
time"). Compute is divided by the share of a core each rank gets when the job's ranks
outnumber the host's cores (a local cluster); what that leaves out (Ray's own processes
on the same cores, other work on the host) is said with the figure.

The measurement is kept in the user's cache under its shape and this host's CPU. `spotline
plan`, and `spotline run` on a local cluster before its ranks start, take it; a run's
controller only reads it (it never times passes beside the ranks), so plan and run
report one prediction. Never used for a GPU job: there the datasheet peak and the
schedule decide.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from spotline import constants
from spotline.config.schema import JobSpec

CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "spotline"
MAX_STAGE_PARAMS = 50_000_000
"""A stage larger than this is not measured here (a CPU job of that size is not run)."""
_REPEATS = 5


@dataclass(frozen=True)
class HostStep:
    """What one step's parts take on this host (see the module)."""

    micro_s: list[float]
    """Each stage's forward + backward of one micro-batch, alone on its threads."""
    optimizer_s: list[float]
    """Each stage's optimizer step over one rank's share."""
    threads: int
    cores: int

    def share(self, ranks_on_host: int) -> float:
        """The share of its threads a rank gets when `ranks_on_host` ranks share the
        host's cores (1 when they fit)."""
        return min(1.0, self.cores / max(1, ranks_on_host * self.threads))


def rank_threads(spec: JobSpec) -> int:
    """The intra-op threads a rank runs with (as the worker sets them)."""
    return max(1, int(spec.resources.cpus_per_worker))


def ranks_on_host(spec: JobSpec, replicas: int) -> int:
    """The job's ranks on one host: resources.ranks_per_node, else all of them (a local
    cluster)."""
    world = spec.parallel.pipeline_stages * replicas
    return min(world, spec.resources.ranks_per_node or world)


def host_step(
    spec: JobSpec, replicas: int, bounds: list[int], measure: bool = True
) -> HostStep | None:
    """This host's measurement for the job's shape (from the cache when it was taken
    before); None when a stage is too large to measure here, or when the model raises
    here: that error is the user's, and the workers report it as theirs, naming their
    code, where the plan would only stop. `measure=False`: the cached measurement only,
    None without one (a running job's controller: timing passes on the cores its ranks
    train on would slow them and skew what they measure)."""
    from spotline.planning.memory_model import stage_params

    if max(stage_params(spec, bounds=bounds)) > MAX_STAGE_PARAMS:
        return None
    threads = rank_threads(spec)
    key = _key(spec, replicas, bounds, threads)
    path = CACHE_DIR / f"host-step-{key}.json"
    try:
        return HostStep(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    if not measure:
        return None
    try:
        got = _measure(spec, replicas, bounds, threads)
    except Exception:  # noqa: BLE001 - the user's model: its error is the workers' to report
        return None
    try:
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(got)))
        os.replace(tmp, path)
    except OSError:
        pass  # not kept: measured again next time
    return got


def _key(spec: JobSpec, replicas: int, bounds: list[int], threads: int) -> str:
    import torch

    shape = {
        "model": spec.model.model_dump(mode="json"),
        "vocab": spec.vocab_size(),
        "micro_batch": spec.micro_batch_size(),
        "zero": spec.parallel.zero_stage,
        "precision": spec.parallel.precision,
        "replicas": replicas,
        "bounds": list(bounds),
        "threads": threads,
        "host": [platform.processor(), platform.machine(), os.cpu_count(), torch.__version__],
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:20]


def _measure(spec: JobSpec, replicas: int, bounds: list[int], threads: int) -> HostStep:
    import torch

    from spotline.models import model_def

    model = model_def(spec)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        mb, seq = spec.micro_batch_size(), spec.model.seq_len
        x = torch.randint(0, spec.vocab_size(), (mb, seq), generator=gen)
        micro, opt = [], []
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            layers = torch.nn.Sequential(*(ld.build() for ld in model.layers[lo:hi]))
            inp = _detached(x)
            micro.append(_best(lambda layers=layers, inp=inp: _pass(layers, inp)))
            with torch.no_grad():
                x = layers(x)
            params = sum(p.numel() for p in layers.parameters())
            share = params // replicas if spec.parallel.zero_stage >= 1 else params
            flat = torch.zeros(max(1, share), requires_grad=True)
            flat.grad = torch.zeros_like(flat)
            adam = torch.optim.AdamW([flat])
            opt.append(_best(adam.step))
    finally:
        torch.set_num_threads(prev)
    return HostStep(micro, opt, threads, os.cpu_count() or 1)


def _detached(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.is_floating_point())
    return type(x)(_detached(t) for t in x)


def _pass(layers, inp) -> None:
    out = layers(inp)
    out = out[0] if isinstance(out, (tuple, list)) else out
    out.float().square().mean().backward()


def _best(fn) -> float:
    fn()  # warm: allocations, kernel choice
    best = float("inf")
    for _ in range(_REPEATS):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def host_source(spec: JobSpec, replicas: int, host: HostStep) -> str:
    """Where a host-measured step comes from, and what it leaves out, in words."""
    n = ranks_on_host(spec, replicas)
    shared = (
        f", {n} rank(s) x {host.threads} thread(s) sharing {host.cores} core(s)"
        if host.share(n) < 1
        else ""
    )
    return (
        f"this host's measured passes and optimizer step{shared} (not counted: Ray's own "
        "processes and other work on the same cores)"
    )


def pass_overheads() -> tuple[float, float]:
    """(per pipeline pass, per step) seconds a CPU step costs beyond its measured parts."""
    return constants.SPOTLINE_PIPE_PASS_OVERHEAD_S, constants.SPOTLINE_STEP_OVERHEAD_S
