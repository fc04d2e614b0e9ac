"""The DeepSpeed config a group of workers runs with, derived from the job spec.

The keys the spec decides (batch, clip, ZeRO stage, precision) come from
`spotline.config.deepspeed_keys`, which also refuses a `deepspeed:` section that
contradicts them when the spec is validated; this module adds what Spotline fixes
for every job, sizes ZeRO's reduction bucket to the stage, and merges the user's
`deepspeed:` section over the result. No DeepSpeed import: the config is plain data.
"""

from __future__ import annotations

from typing import Any

from spotline.config.deepspeed_keys import spec_keys, zero_bucket_elements
from spotline.config.schema import JobSpec

SPOTLINE_KEYS: dict[str, Any] = {
    "zero_allow_untested_optimizer": True,  # Spotline builds its own AdamW
    "steps_per_print": 10**9,  # progress goes through Spotline's reports
    "wall_clock_breakdown": False,
}
"""Keys Spotline sets for every job (the `deepspeed:` section may override them)."""


def deepspeed_config(
    spec: JobSpec, replicas: int, stage_params: int | None = None
) -> dict[str, Any]:
    """The DeepSpeed config of a group of `replicas` (of a stage of `stage_params`
    parameters): derived from the spec, with the `deepspeed:` section merged over it
    (its keys never contradict the derived ones: validation refuses those)."""
    derived = {**spec_keys(spec, replicas), **SPOTLINE_KEYS}
    bucket = zero_bucket_elements(spec, stage_params) if stage_params else None
    if bucket is not None:
        derived["zero_optimization"]["reduce_bucket_size"] = bucket
    return _deep_merge(derived, spec.deepspeed)


def _deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = (
            _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out
