"""Where the plan cuts the pipeline, and why its bubble is too large.

`planned_bounds` is the cut `spotline plan` predicts at (the spec's explicit layer
counts, the FLOP-balanced cut for `partition: balanced`, else DeepSpeed's uniform one).
`bubble_warning` tells apart the two causes of a bubble over the threshold: too few
micro-batches for the stages, or stages of unequal work, which more micro-batches do
not change; each with the field that lowers it.
"""

from __future__ import annotations

from spotline.config.schema import JobSpec
from spotline.models import model_def
from spotline.plan import (
    BUBBLE_WARN_FRACTION,
    StepPrediction,
    choose_partition,
    predict_step,
    stage_flops_per_token,
)


def planned_bounds(spec: JobSpec, replicas: int) -> list[int]:
    """The stage bounds the job is planned at: parallel.partition's layer counts, the
    cut that evens out the stages' FLOPs for 'balanced' (what its start-up measurement
    finds on equal devices), else DeepSpeed's uniform cut."""
    if spec.parallel.partition == "balanced" and spec.parallel.pipeline_stages > 1:
        return flops_balanced_bounds(spec)
    return choose_partition(spec, replicas)["bounds"]


def flops_balanced_bounds(spec: JobSpec) -> list[int]:
    """The contiguous cut of the layers whose busiest stage does the least work."""
    from spotline.models.partition import balanced_bounds

    model = model_def(spec)
    per_layer = stage_flops_per_token(spec, model, list(range(len(model.layers) + 1)))
    return balanced_bounds(per_layer, [1.0] * spec.parallel.pipeline_stages)


def bubble_warning(spec: JobSpec, replicas: int, step: StepPrediction, bounds: list[int]) -> str:
    """Why the bubble is over BUBBLE_WARN_FRACTION, and what lowers it: more
    micro-batches when there are too few for the stages; when there are enough, the
    stages do unequal work, which more micro-batches do not change: a better cut."""
    from spotline.models.partition import sizes_from_bounds

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
