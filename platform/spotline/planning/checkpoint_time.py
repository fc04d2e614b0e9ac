"""Checkpoints predicted from the spec: their size, the busiest rank's share, how long a
just-in-time save takes, and whether it commits within the notices the job's sources give.

Before the job has measured its own saves, a save is the busiest rank's bytes at an
assumed rate (`SPOTLINE_ASSUMED_SAVE_MB_PER_S`, capped by
checkpoint.upload_max_mb_per_s) plus a fixed part. The preflight and `spotline plan`
warn with `jit_fit_problem`; the controller asks it again with measured figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from spotline import constants
from spotline.config.schema import JobSpec
from spotline.planning.memory_model import ADAM_BYTES, MASTER_BYTES, precision, stage_params


def checkpoint_bytes(spec: JobSpec) -> int:
    """Bytes of one committed checkpoint: full fp32 weights and both Adam moments of every
    parameter, once (per-rank RNG files are a few KB)."""
    return sum(stage_params(spec)) * (MASTER_BYTES + ADAM_BYTES)


SAVE_FIXED_S = 1.0  # host copy set-up, the receipt, the commit poll and the manifest


def save_bytes_per_rank(spec: JobSpec, replicas: int) -> int:
    """Bytes the busiest rank writes per checkpoint: its ZeRO share of the largest
    stage's fp32 master and moments (all of them at ZeRO-0, on replica 0), plus that
    stage's bf16 module weights, which replica 0 writes once per stage."""
    p = spec.parallel
    biggest = max(stage_params(spec))
    share = (MASTER_BYTES + ADAM_BYTES) * biggest / (replicas if p.zero_stage >= 1 else 1)
    if precision(spec) == "bf16":
        share += 2 * biggest
    return math.ceil(share)


def predicted_save_s(spec: JobSpec, replicas: int, bytes_per_s: float | None = None) -> float:
    """Seconds from a save request to the commit, before the job has measured its own:
    the busiest rank's bytes at `bytes_per_s` (default SPOTLINE_ASSUMED_SAVE_MB_PER_S,
    capped by checkpoint.upload_max_mb_per_s), plus a fixed part."""
    rate = bytes_per_s or constants.SPOTLINE_ASSUMED_SAVE_MB_PER_S * 1e6
    cap = spec.checkpoint.upload_max_mb_per_s
    if cap is not None:
        rate = min(rate, cap * 1e6)
    return save_bytes_per_rank(spec, replicas) / rate + SAVE_FIXED_S


def notice_deadlines(spec: JobSpec) -> list[tuple[str, float]]:
    """(source kind, seconds) of each notice source of the job: its default_deadline_s,
    else its protocol's usual notice (aws 120 s; gcp, azure, ray-drain, sigterm 30 s)."""
    from spotline.registry import NOTICE_SOURCES

    return [
        (s.kind, float(s.default_deadline_s or NOTICE_SOURCES.load(s.kind).default_deadline_s))
        for s in spec.preemption.sources
    ]


def shortest_notice(spec: JobSpec) -> tuple[str, float] | None:
    """(source kind, seconds) of the shortest notice the job's sources give, or None
    without sources."""
    return min(notice_deadlines(spec), key=lambda n: n[1], default=None)


def jit_fit_problem(
    spec: JobSpec,
    replicas: int,
    save_s: float | None = None,
    step_s: float = 0.0,
    how: str | None = None,
) -> str | None:
    """Why a just-in-time checkpoint may not commit before the shortest notice ends
    (None when it fits, or there are no sources). `save_s`/`step_s`: measured figures,
    or predicted ones `how` says where from; without them, the prediction from the
    state size."""
    notice = shortest_notice(spec)
    if notice is None:
        return None
    kind, deadline = notice
    margin = constants.SPOTLINE_JIT_MARGIN_S
    measured = save_s is not None
    if save_s is None:
        save_s = predicted_save_s(spec, replicas)
    need = save_s + step_s
    if need <= deadline - margin:
        return None
    mb = save_bytes_per_rank(spec, replicas) / 1e6
    how = (
        (f"predicted {how}" if how else "measured")
        if measured
        else (
            f"predicted: {mb:,.0f} MB from the busiest rank at "
            f"{constants.SPOTLINE_ASSUMED_SAVE_MB_PER_S:.0f} MB/s"
        )
    )
    return (
        f"a just-in-time checkpoint at {replicas} replica(s) takes about {need:.0f}s ({how}"
        f"{f', plus a {step_s:.1f}s step' if step_s else ''}), and a {kind} notice gives "
        f"{deadline:.0f}s less a {margin:.0f}s margin: it may not commit before the node "
        "goes, and the job would resume from the previous checkpoint. Write less per rank "
        "(more replicas, or parallel.zero_stage >= 1), lift checkpoint.upload_max_mb_per_s, "
        "or lower checkpoint.interval_steps so that a lost notice costs fewer steps"
    )


@dataclass(frozen=True)
class NoticeFit:
    """Whether a just-in-time save commits within one notice source's deadline."""

    source: str
    deadline_s: float
    save_s: float
    """Predicted seconds from the save request to the commit (plus one step)."""
    fits: bool
