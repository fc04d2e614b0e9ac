"""The whole plan: what a job will need and do, predicted from the spec before launch.

Memory per device (`planning.memory_model`), the step time, bubble and MFU
(`planning.step`), the checkpoint and its just-in-time save against the notices
(`planning.checkpoint_time`), the cost of a billion tokens, and warnings, each with the field to
change: a stage that cannot fit, a save that cannot commit in time, a bubble over
`BUBBLE_WARN_FRACTION` (`bubble_warning` tells its two causes apart). `spotline plan`
prints `Plan.render()`; the job's summary puts the plan beside what the run measured.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from spotline import constants
from spotline.config.schema import JobSpec
from spotline.planning.checkpoint_time import (
    NoticeFit,
    checkpoint_bytes,
    jit_fit_problem,
    notice_deadlines,
    predicted_save_s,
    save_bytes_per_rank,
)
from spotline.planning.choice import flops_balanced_bounds, planned_bounds
from spotline.planning.host_step import host_source, host_step
from spotline.planning.memory_model import StageMemory, memory_per_device, memory_problem, precision
from spotline.planning.partition import sizes_from_bounds
from spotline.planning.peer_memory import LEVELS, NodePeerMemory
from spotline.planning.spot import SpotRecovery, spot_recovery
from spotline.planning.step import StepPrediction, predict_step, stage_flops_per_token

BUBBLE_WARN_FRACTION = 0.25


@dataclass(frozen=True)
class Plan:
    """What the job will need and do, predicted before launch (`spotline plan`)."""

    name: str
    replica_counts: list[int]
    """Replica counts the batch policy allows, with their global batch and micro-batches."""
    batches: dict[int, dict[str, int]]
    replicas: int
    """The count the per-device figures below are for: the smallest, where ZeRO splits
    state the least."""
    stages: list[StageMemory]
    device_bytes: int | None
    device_source: str | None
    step: StepPrediction
    rate_source: str | None
    """Where the FLOP/s came from (a datasheet peak, a probe, --peak-tflops); None: none."""
    tokens_per_step: int
    checkpoint_bytes: int
    save_bytes_per_rank: int
    notices: list[NoticeFit]
    usd_per_1b_tokens: dict[str, float | None]
    """'spot' and 'on_demand' dollars for 1e9 tokens at the predicted step time."""
    warnings: list[str]
    adaptive_max_batch: int | None = None
    """train.adaptive.max_batch_size under the adaptive batch schedule."""
    precision: str = "fp32"
    """The precision the figures are for (parallel.precision, 'auto' resolved), whose
    peak the MFU is against."""
    activation_checkpointing: int = 0
    peer_memory: NodePeerMemory | None = None
    """The busiest node's state keeper (recovery.peer_snapshots), against its budget."""
    ranks_per_node: int = 0
    spot: SpotRecovery | None = None
    """A just-in-time save against each cloud's notice, peer snapshots against the
    node's memory, a restore from peer memory and from storage."""
    unchecked: list[str] = dataclasses.field(default_factory=list)
    """What the figures assume without having read it (a tokenizer not read)."""

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.peer_memory is not None:
            out["peer_memory"].update(
                need=self.peer_memory.need,
                full=self.peer_memory.full,
                restore_peak=self.peer_memory.restore_peak,
                level=self.peer_memory.level.describe(),
            )
        for st, mem in zip(out["stages"], self.stages, strict=True):
            st.update(state_bytes=mem.state_bytes, total_bytes=mem.total_bytes)
            if self.device_bytes:
                st["headroom_bytes"] = self.device_bytes - mem.total_bytes
        return out

    def render(self) -> str:
        gb = 1e9
        lines = [f"Spotline plan for {self.name}"]
        lines.append(
            "  replicas          "
            + ", ".join(
                f"{d} (batch {b['global_batch']}, {b['micro_batches']} micro-batches)"
                for d, b in self.batches.items()
            )
        )
        have = (
            f"device {self.device_bytes / gb:,.2f} GB ({self.device_source})"
            if self.device_bytes
            else "device memory unknown (set resources.device_memory_gb)"
        )
        lines.append(f"  memory per device at {self.replicas} replica(s); {have}")
        recompute = (
            f", activations recomputed in every {self.activation_checkpointing}-th block"
            if self.activation_checkpointing > 1
            else ", activations recomputed in every block"
            if self.activation_checkpointing == 1
            else ""
        )
        lines.append(f"  precision         {self.precision}{recompute}")
        for m in self.stages:
            room = (
                f", headroom {(self.device_bytes - m.total_bytes) / gb:,.2f} GB"
                if self.device_bytes
                else ""
            )
            lines.append(
                f"    stage {m.stage}: {m.params:,} params; weights {m.weight_bytes / gb:.3f}, "
                f"grads {m.grad_bytes / gb:.3f}, optimizer {m.optimizer_bytes / gb:.3f}, "
                f"bucket {m.bucket_bytes / gb:.3f}, "
                f"activations {m.activation_bytes / gb:.3f} ({m.micro_batches_in_flight} "
                f"micro-batch(es) in flight) = {m.total_bytes / gb:.3f} GB{room}"
            )
        lines.append(
            "    (not counted: the optimizer step's temporaries, the allocator's cache, and "
            "activations a block keeps beyond a GPT block's 34·s·b·h, e.g. about 1.5x for "
            "a Llama block)"
        )
        st = self.step
        if self.stages and len(self.stages) > 1:
            free = (
                f"; {st.backfill_s_per_step:.3g} device-s per step left for backfill"
                if st.backfill_s_per_step is not None
                else ""
            )
            lines.append(
                f"  bubble            {st.bubble_fraction:.1%} of each step (equal stages: "
                f"{st.theory:.1%}){free}"
            )
        if st.step_s is not None:
            mfu = f", MFU {st.mfu:.1%}" if st.mfu is not None else ""
            lines.append(
                f"  step time         {st.step_s:.3g} s at {self.rate_source}{mfu}; "
                f"{self.tokens_per_step / st.step_s:,.0f} tokens/s"
            )
        else:
            lines.append("  step time         unknown: no device FLOP/s (pass --peak-tflops)")
        if self.adaptive_max_batch is not None:
            lines.append(
                f"  adaptive batch    grows to at most {self.adaptive_max_batch} sequences: "
                "memory per device stays (the micro-batch is fixed); the step time above is "
                f"at {self.batches[self.replicas]['global_batch']} sequences and grows with "
                "the batch, the cost per token stays"
            )
        lines.append(
            f"  checkpoint        {self.checkpoint_bytes / gb:,.3f} GB; the busiest rank "
            f"writes {self.save_bytes_per_rank / gb:,.3f} GB"
        )
        for n in self.notices:
            lines.append(
                f"    {n.source} notice {n.deadline_s:.0f}s: just-in-time save about "
                f"{n.save_s:.1f}s, {'fits' if n.fits else 'does NOT fit'}"
            )
        if self.spot is not None:
            lines += self.spot.render()
        usd = self.usd_per_1b_tokens
        if any(v is not None for v in usd.values()):
            parts = [f"${v:,.2f} {k.replace('_', '-')}" for k, v in usd.items() if v is not None]
            lines.append(f"  cost of 1B tokens {', '.join(parts)}")
        lines += [f"  unchecked: {u}" for u in self.unchecked]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def make_plan(
    spec: JobSpec,
    device: tuple[int, str] | None = None,
    rate: tuple[float, float | None, str] | None = None,
    node: tuple[int, int | None] = (8, None),
    bandwidth: tuple[float | None, float | None] = (None, None),
    unchecked: list[str] | None = None,
    on_host: bool = False,
) -> Plan:
    """The plan of `spec`. `device`: (bytes, where that figure comes from) of one device;
    `rate`: (FLOP/s a device runs at, its peak FLOP/s for MFU, where they come from);
    `node`: (ranks on one node, its host RAM or None); `bandwidth`: (one node's to
    object storage, between two nodes) in Gbit/s, None where not stated; `unchecked`:
    what the spec's figures assume without having read it; `on_host`: a CPU job planned
    on the host it runs on, whose step is measured here (`planning.host_step`)."""
    counts = spec.replica_counts()
    d = counts[0]
    flops_per_s, peak, rate_source = rate if rate else (None, None, None)
    bounds = planned_bounds(spec, d)
    host = host_step(spec, d, bounds) if on_host else None
    step = predict_step(spec, d, flops_per_s, peak, bounds, host)
    if host is not None:
        rate_source = host_source(spec, d, host)
    tokens = spec.global_batch(d) * spec.model.seq_len
    warnings = []
    if device is not None:
        problem = memory_problem(spec, *device)
        if problem:
            warnings.append(problem)
    if step.bubble_fraction > BUBBLE_WARN_FRACTION:
        warnings.append(bubble_warning(spec, d, step, bounds))
    spot = spot_recovery(spec, d, node[0], node[1], *bandwidth, step.step_s, bounds)
    # A stated bandwidth makes the node's link the bound; else each rank's assumed rate.
    save_s = spot.save_s if bandwidth[0] else predicted_save_s(spec, d)
    margin = constants.SPOTLINE_JIT_MARGIN_S
    notices = []
    for kind, deadline in notice_deadlines(spec):
        need_s = save_s + (step.step_s or 0.0)
        notices.append(NoticeFit(kind, deadline, need_s, need_s <= deadline - margin))
    stated = f"at {bandwidth[0]:g} Gbit/s a node" if bandwidth[0] else None
    problem = jit_fit_problem(
        spec, d, save_s if stated else None, step_s=step.step_s or 0.0, how=stated
    )
    if problem:
        warnings.append(problem)
    peers = spot.peer
    if peers is not None and peers.level != LEVELS[0]:
        warnings.append(
            f"recovery.peer_memory: peer snapshots need {peers.render()}; raise "
            "recovery.peer_memory, spread the ranks over more nodes, or set "
            "recovery.peer_snapshots: false"
        )
    m = spec.metrics
    usd: dict[str, float | None] = {"spot": None, "on_demand": None}
    if step.step_s is not None:
        hours = 1e9 / tokens * step.step_s * d * spec.parallel.pipeline_stages / 3600
        for key, price in (
            ("spot", m.spot_usd_per_device_hour),
            ("on_demand", m.on_demand_usd_per_device_hour),
        ):
            usd[key] = None if price is None else hours * price
    return Plan(
        name=spec.name,
        replica_counts=counts,
        batches={
            r: {"global_batch": spec.global_batch(r), "micro_batches": spec.grad_accum(r)}
            for r in counts
        },
        replicas=d,
        stages=memory_per_device(spec, d, bounds),
        device_bytes=device[0] if device else None,
        device_source=device[1] if device else None,
        step=step,
        rate_source=rate_source,
        tokens_per_step=tokens,
        checkpoint_bytes=checkpoint_bytes(spec),
        save_bytes_per_rank=save_bytes_per_rank(spec, d),
        notices=notices,
        usd_per_1b_tokens=usd,
        warnings=warnings,
        adaptive_max_batch=(
            spec.train.adaptive.max_batch_size if spec.train.batch_schedule == "adaptive" else None
        ),
        precision=precision(spec),
        activation_checkpointing=spec.parallel.activation_checkpointing,
        peer_memory=peers,
        ranks_per_node=node[0],
        spot=spot,
        unchecked=list(unchecked or []),
    )


def time_cpu_step_here(spec: JobSpec) -> None:
    """Before a CPU job's ranks start on a local cluster: its step's parts timed on this
    host at each replica count it may run at, cut as planned, and kept
    (`planning.host_step`), so that its run's "plan vs run" reports the step `spotline
    plan` predicts, without the controller timing anything beside the ranks. Cached per
    shape: a job run again is not timed again. A job that will run on a GPU is not
    timed; a balanced cut, measured as the ranks start, is not known here."""
    import torch

    device = spec.resources.device
    if device == "gpu" or (device == "auto" and torch.cuda.is_available()):
        return
    try:
        for d in spec.replica_counts():
            host_step(spec, d, planned_bounds(spec, d))
    except Exception:  # noqa: BLE001 - a prediction is a report, never a reason not to start
        # The model's own errors are the workers' to report, naming the user's code.
        logging.getLogger("spotline.plan").debug("the CPU step was not timed", exc_info=True)


def bubble_warning(spec: JobSpec, replicas: int, step: StepPrediction, bounds: list[int]) -> str:
    """Why the bubble is over BUBBLE_WARN_FRACTION, and what lowers it: more
    micro-batches when there are too few for the stages; when there are enough, the
    stages do unequal work, which more micro-batches do not change: a better cut."""
    p, m = spec.parallel.pipeline_stages, spec.grad_accum(replicas)
    head = (
        f"the pipeline bubble is {step.bubble_fraction:.0%} of each step (over "
        f"{BUBBLE_WARN_FRACTION:.0%})"
    )
    if step.theory > BUBBLE_WARN_FRACTION:
        need = 3 * (p - 1)  # (p-1)/(m+p-1) <= 0.25 at m >= 3(p-1)
        return (
            f"{head}: {m} micro-batch(es) per replica leave (p-1)/(m+p-1) = {step.theory:.0%} "
            f"of it idle with {p} stages; raise parallel.micro_batches from "
            f"{spec.parallel.micro_batches} to {need} or more (train.global_batch_size a "
            "multiple of micro_batches x elastic.max_replicas), or lower "
            "parallel.pipeline_stages"
        )
    work = stage_flops_per_token(spec, bounds=bounds)
    heavy = max(range(p), key=work.__getitem__)
    light = min(range(p), key=work.__getitem__)
    why = (
        f"{head}, where {m} micro-batch(es) per replica would leave {step.theory:.0%} with "
        f"equal stages: stage {heavy} does {work[heavy] / max(work[light], 1e-9) - 1:.0%} "
        f"more work per micro-batch than stage {light}, which waits for it (more "
        "micro-batches do not change that)"
    )
    best = flops_balanced_bounds(spec)
    better = predict_step(spec, replicas, bounds=best).bubble_fraction
    if best != bounds and better < step.bubble_fraction - 0.005:
        also = (
            ""
            if spec.parallel.partition == "balanced"
            else ", or parallel.partition: balanced, which cuts by the layer times measured "
            "at start-up"
        )
        return (
            f"{why}; parallel.partition: {sizes_from_bounds(best)} (layers per stage, the "
            f"embedding and head included) brings it to {better:.0%}{also}"
        )
    return (
        f"{why}; no cut of the {bounds[-1]} layers evens the stages out: lower "
        "parallel.pipeline_stages"
    )
