"""The DeepSpeed config keys a job spec decides, and the check that the spec's own
`deepspeed:` section does not contradict them.

This is the one derivation of those keys from the spec. Validation uses it (a
contradiction is one line at load time, before any worker starts), the planner uses
the reduction bucket size, and `spotline.train.ds_config` builds the whole DeepSpeed
config of a group on it. Pure functions of the spec: no DeepSpeed import, no runtime.
"""

from __future__ import annotations

from typing import Any

from spotline.config.batch import ABSENT, BatchPolicy, dig

DEEPSPEED_REDUCE_BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's default zero_optimization.reduce_bucket_size."""

OWNED_KEYS: dict[str, str | None] = {
    "train_batch_size": "train.global_batch_size",
    "train_micro_batch_size_per_gpu": "train.global_batch_size / (parallel.micro_batches "
    "x elastic.max_replicas)",
    "gradient_accumulation_steps": "parallel.micro_batches and elastic.batch_policy",
    "gradient_clipping": "train.grad_clip",
    "zero_optimization.stage": "parallel.zero_stage",
    "bf16.enabled": "parallel.precision",
    "fp16.enabled": "parallel.precision (fp32 or bf16; fp16 is not supported)",
    "optimizer": None,
    "scheduler": None,
}
"""deepspeed: keys Spotline derives, and the spec field each comes from (None: Spotline
supplies the object itself, so the key cannot be set at all)."""


def spec_keys(spec: BatchPolicy, replicas: int) -> dict[str, Any]:
    """The DeepSpeed keys the spec decides for a group of `replicas` replicas: the batch
    (at the start of an adaptive schedule), the gradient clip, the ZeRO stage and the
    precision."""
    p, t = spec.parallel, spec.train
    return {
        "train_batch_size": spec.global_batch(replicas),
        "train_micro_batch_size_per_gpu": spec.micro_batch_size(),
        "gradient_accumulation_steps": spec.grad_accum(replicas),
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": p.zero_stage},
        "bf16": {"enabled": p.precision == "bf16"},
        "fp16": {"enabled": False},
    }


def zero_bucket_elements(spec: BatchPolicy, stage_params: int) -> int | None:
    """Elements of the gradient-reduction bucket DeepSpeed's ZeRO-1/2 allocates on
    every rank of a stage of `stage_params` parameters (None without ZeRO).

    DeepSpeed allocates its whole reduce_bucket_size (5e8 elements: 2 GB in fp32)
    whatever the model's size. A bucket larger than the stage holds nothing more,
    so Spotline sizes it to the stage, never above DeepSpeed's default, unless
    deepspeed.zero_optimization.reduce_bucket_size is set.
    """
    if spec.parallel.zero_stage not in (1, 2):
        return None
    given = dig(spec.deepspeed, ["zero_optimization", "reduce_bucket_size"])
    if given is not ABSENT:
        return int(given)
    return max(1, min(DEEPSPEED_REDUCE_BUCKET_ELEMENTS, stage_params))


def check_deepspeed_keys(spec: BatchPolicy) -> None:
    """Raise ValueError (one line naming the key and the field to set instead) when a
    `deepspeed:` key that Spotline derives from the spec disagrees with it at any
    replica count the job may run at; otherwise which one wins is a guess."""
    for key, owner in OWNED_KEYS.items():
        path = key.split(".")
        given = dig(spec.deepspeed, path)
        if given is ABSENT:
            continue
        if owner is None:
            raise ValueError(
                f"deepspeed.{key} cannot be set: Spotline builds AdamW and the warm-up + "
                "cosine schedule from train.lr, train.warmup_steps, train.min_lr_ratio "
                f"and train.weight_decay; remove deepspeed.{key} and set those instead"
            )
        derived = {dig(spec_keys(spec, d), path) for d in spec.replica_counts()}
        if derived != {given}:
            want = " or ".join(str(v) for v in sorted(derived, key=str))
            raise ValueError(
                f"deepspeed.{key} ({given!r}) contradicts the value Spotline derives "
                f"from {owner} ({want}); remove deepspeed.{key} and set {owner}"
            )
