"""The user's job, made to run on a local cluster of simulated spot nodes, saying what
changed; and the check that it fits this machine, naming the flags that would make it.

What stays the user's: the model (unless --scale-model), tokenizer, data, batch policy,
elastic bounds, checkpoint interval, recovery and notice settings, seed and steps. What
changes, and is said: CPU compute, workers placed on spot nodes (one `spot_gpu` each),
cloud notice sources read as Ray drains (how the trace delivers notices), checkpoints in
a scratch directory, experiment trackers off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from spotline.config import JobSpec, SpecError, apply_overrides
from spotline.config.loader import validate_dict

# Notices arrive through Ray's drain (the trace); what a cloud's own source would have
# polled is read from there. A drain is polled this often at most.
DRAIN_POLL_S = 0.5
# The fit check: what ranks on this machine may hold, as a share of its available RAM,
# and the fewest steps the run should train (a verdict over fewer says little).
MEMORY_SHARE = 0.6
MIN_STEPS = 30
# CPU FLOP/s one worker reaches on the small matmuls of a shrunk model: the time check's
# yardstick (a laptop core gives 10-50 GFLOP/s in fp32).
CPU_FLOPS_PER_WORKER = 5e9
# What --scale-model shrinks to: a replica of this size trains a step in well under a
# second on two cores.
SMALL = {"d_model": 128, "n_heads": 4, "seq_len": 128, "tokens_per_step": 16_384}


@dataclass
class Adapted:
    spec: JobSpec
    changes: list[str] = field(default_factory=list)
    """What changed, one line each: `field: old -> new (why)`."""
    scaled: list[str] = field(default_factory=list)
    """What --scale-model shrank (also in `changes`)."""


def _get(raw: dict[str, Any], dotted: str) -> Any:
    node: Any = raw
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _short(v: Any) -> str:
    text = str(v)
    return text if len(text) <= 60 else text[:57] + "..."


class _Edits:
    def __init__(self, raw: dict[str, Any]) -> None:
        self.raw = raw
        self.over: dict[str, Any] = {}
        self.lines: list[str] = []

    def set(self, dotted: str, value: Any, why: str) -> None:
        old = _get(self.raw, dotted)
        if old == value:
            return
        self.over[dotted] = value
        self.lines.append(f"{dotted}: {_short(old)} -> {_short(value)} ({why})")


def adapt(
    spec: JobSpec,
    *,
    name: str,
    checkpoint_uri: str,
    staging_dir: str,
    scale_model: bool = False,
    notices: str = "keep",
) -> Adapted:
    """`spec` as the job `name` on the spot nodes of a local chaos cluster. `notices`:
    'keep' reads the spec's own notice sources from Ray's drain (none stays none: the
    job does not see notices); 'drain' also gives a job without one Ray's drain."""
    raw = spec.model_dump(mode="json")
    e = _Edits(raw)
    e.set("name", name, "the rehearsal's own name: your job's record is left alone")
    if spec.resources.device != "cpu":
        e.set("resources.device", "cpu", "simulated spot nodes compute on this machine's CPU")
    stages = spec.parallel.pipeline_stages
    own = [spec.resources.stage(s) for s in range(stages)]
    placed = [{"cpus": s.cpus, "resources": {"spot_gpu": 1}} for s in own]
    e.set("resources.stages", placed, "each worker takes one spot_gpu of a simulated spot node")
    sources = raw["preemption"]["sources"]
    if not sources and notices == "drain":
        drain = [{"kind": "ray-drain", "poll_interval_s": DRAIN_POLL_S}]
        e.set("preemption.sources", drain, "notices arrive as Ray drains")
    elif sources:
        poll = min([DRAIN_POLL_S, *(s.get("poll_interval_s") or DRAIN_POLL_S for s in sources)])
        drain = [{"kind": "ray-drain", "poll_interval_s": poll}]
        kinds = ", ".join(s["kind"] for s in sources)
        e.set(
            "preemption.sources",
            drain,
            f"the trace's notices arrive as Ray drains; {kinds} read them",
        )
    e.set("checkpoint.uri", checkpoint_uri, "a scratch directory, deleted at the end")
    e.set("checkpoint.staging_dir", staging_dir, "a scratch directory")
    for key in ("endpoint_url", "resume_from"):
        if raw["checkpoint"].get(key) is not None:
            e.set(f"checkpoint.{key}", None, "the scratch checkpoints are local files")
    if raw["checkpoint"].get("storage_options"):
        e.set("checkpoint.storage_options", {}, "the scratch checkpoints are local files")
    if raw.get("tracking"):
        e.set("tracking", [], "a rehearsal logs to no experiment tracker")
    scaled: list[str] = []
    if scale_model:
        before = len(e.lines)
        _scale(spec, e)
        scaled = e.lines[before:]
    out = validate_dict(apply_overrides(raw, e.over), f"{spec.name} for spotline chaos")
    return Adapted(out, e.lines, scaled)


def _scale(spec: JobSpec, e: _Edits) -> None:
    """Shrink a gpt or llama model and an outsized batch to what trains on two cores."""
    m = spec.model
    why = "--scale-model"
    if m.kind == "custom":
        raise SpecError(
            "--scale-model shrinks gpt and llama models; a custom provider's shape is "
            "yours: shrink it with --set model.config.FIELD=VALUE (e.g. its width and depth)"
        )
    stages = spec.parallel.pipeline_stages
    if m.n_layers > 2 * stages:
        e.set("model.n_layers", 2 * stages, why)
    d = min(m.d_model, SMALL["d_model"])
    heads = min(m.n_heads, SMALL["n_heads"])
    while d % heads or (m.kind == "llama" and (d // heads) % 2):
        heads -= 1
    e.set("model.d_model", d, why)
    e.set("model.n_heads", heads, why)
    if m.kind == "llama":
        kv = m.kv_heads
        kv = max(k for k in range(1, heads + 1) if heads % k == 0 and k <= kv)
        if m.n_kv_heads is not None or kv != heads:
            e.set("model.n_kv_heads", kv, why)
        if m.ffn_hidden is not None:
            e.set("model.ffn_hidden", 4 * d, why)
        if m.preset is not None:
            e.set("model.preset", None, f"{why} (the shape is given field by field)")
        if m.init_from is not None:
            e.set("model.init_from", None, f"{why} (its weights have the old shape)")
    seq = min(m.seq_len, SMALL["seq_len"])
    e.set("model.seq_len", seq, why)
    per_step = spec.train.global_batch_size * seq
    if per_step > SMALL["tokens_per_step"] and spec.train.batch_schedule == "fixed":
        unit = spec.parallel.micro_batches * spec.elastic.max_replicas
        rows = max(1, SMALL["tokens_per_step"] // (seq * unit))
        e.set("train.global_batch_size", rows * unit, why)


# --- does it fit this machine --------------------------------------------------------------


@dataclass
class Footprint:
    ranks: int
    rank_bytes: int
    params: int
    step_s: float
    """A rough step time on this machine's CPU (`CPU_FLOPS_PER_WORKER`)."""

    def describe(self) -> str:
        from spotline.units import human_bytes

        return (
            f"{self.ranks} ranks x {human_bytes(self.rank_bytes)} = "
            f"{human_bytes(self.ranks * self.rank_bytes)}, {self.params:,} parameters, "
            f"about {self.step_s:.2g}s a step"
        )


def footprint(spec: JobSpec) -> Footprint:
    """What the job needs here: memory per rank (weights, gradients, optimizer state,
    activations) at its largest shape, and a rough step time."""
    from spotline.models import model_def
    from spotline.planning.memory_model import memory_per_device

    replicas = spec.elastic.max_replicas
    stages = memory_per_device(spec, replicas)
    worst = max(m.total_bytes for m in stages)
    params = sum(m.params for m in stages)
    tokens = spec.global_batch(replicas) * spec.model.seq_len
    flops = model_def(spec).flops_per_token * tokens
    ranks = replicas * spec.parallel.pipeline_stages
    step_s = flops / (CPU_FLOPS_PER_WORKER * ranks)
    return Footprint(ranks, worst, params, step_s)


def check_fits(
    adapted: Adapted,
    duration_s: float,
    available_bytes: int,
    shrunk: Adapted | None,
    flag_hint: str,
) -> Footprint:
    """Refuse a job too big for this machine (its ranks' memory, or too slow to train
    `MIN_STEPS` steps in the run), naming what would make it fit: `shrunk` is the job
    under --scale-model (None when it cannot shrink), `flag_hint` the flags to show."""
    from spotline.units import human_bytes

    need = footprint(adapted.spec)
    room = int(available_bytes * MEMORY_SHARE)
    too_big = need.ranks * need.rank_bytes > room
    too_slow = need.step_s * MIN_STEPS > duration_s
    if not (too_big or too_slow):
        return need
    why = (
        f"its {need.ranks} ranks need {human_bytes(need.ranks * need.rank_bytes)} "
        f"({human_bytes(need.rank_bytes)} each) and this machine can give them "
        f"{human_bytes(room)} ({MEMORY_SHARE:.0%} of {human_bytes(available_bytes)} "
        "available)"
        if too_big
        else f"a step would take about {need.step_s:.2g}s here ({need.params:,} parameters), "
        f"fewer than {MIN_STEPS} steps in a {duration_s:g}s run"
    )
    if shrunk is not None and not adapted.scaled:
        small = footprint(shrunk.spec)
        fix = (
            f"rerun with --scale-model ({'; '.join(shrunk.scaled)}: {small.describe()}), "
            f"or shrink it yourself with {flag_hint}"
        )
    else:
        fix = f"shrink it further with {flag_hint}"
    raise SpecError(f"{adapted.spec.name}: too big for this machine: {why}; {fix}")


def set_flags(scaled: list[str]) -> str:
    """The --set flags that make the changes of --scale-model (its `scaled` lines)."""
    flags = []
    for line in scaled:
        key, _, rest = line.partition(": ")
        new = rest.split(" -> ", 1)[1].rsplit(" (", 1)[0]
        flags.append(f"--set {key}={'null' if new == 'None' else new}")
    return " ".join(flags) or "--set model.d_model=... --set model.n_layers=..."


def machine_memory() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def worker_cpus(spec: JobSpec) -> float:
    """Logical CPUs one spot node offers: one replica's workers' reservations."""
    return max(
        1.0,
        math.ceil(
            sum(spec.resources.stage(s).cpus or 0.0 for s in range(spec.parallel.pipeline_stages))
        ),
    )
