"""DeepSpeed's private names that Spotline uses: one function per need, checked at import.

Where an optimizer keeps its fp32 master weights (ZeRO-1/2, BF16_Optimizer, ZeRO-3,
FP16_UnfusedOptimizer), a parameter's fragment of them, the pipeline engine's
instruction table and loss reduction, and the process-wide groups DeepSpeed caches.
Names that exist only once an optimizer is built are checked in DeepSpeed's source.

Imported where an engine is built or exists, after `train.process.import_deepspeed`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import deepspeed
import torch

from spotline.compat import Pinned

PIN = "deepspeed==0.19.8"  # pyproject.toml's
_ds = Pinned("deepspeed", deepspeed.__version__, PIN)

_comm = _ds.module("deepspeed.comm.comm", "cdb")
_groups = _ds.module("deepspeed.utils.groups")
_ds.module(
    "deepspeed.runtime.pipe.engine",
    "PipelineEngine._INSTRUCTION_MAP",
    "PipelineEngine._aggregate_total_loss",
)
_ds.module(
    "deepspeed.runtime.zero.stage3",
    "DeepSpeedZeroOptimizer_Stage3._get_param_partition_rank",
    "DeepSpeedZeroOptimizer_Stage3._reassign_or_swap_out_partitioned_parameters",
)
_ds.defined(
    "deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3.fp32_partitioned_groups_flat"
)
_ds.defined(
    "deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.single_partition_of_fp32_groups"
)
_ds.defined("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer.fp32_groups_flat_partition")
_ds.defined(
    "deepspeed.runtime.fp16.unfused_optimizer",
    "FP16_UnfusedOptimizer.fp16_groups",
    "FP16_UnfusedOptimizer.fp32_groups",
)
_ds.defined("deepspeed.utils.mixed_precision_linkage", "._hp_mapping")
_ds.defined(
    "deepspeed.utils.tensor_fragment",
    "tensor_fragment.hp_fragment",
    "tensor_fragment.hp_fragment_address",
    "tensor_fragment.lp_fragment_address",
    "tensor_fragment.param_group_index",
    "fragment_address.start",
    "fragment_address.numel",
)


# --- where an optimizer keeps the fp32 master ------------------------------------------


def flat_fp32_partitions(optimizer: Any) -> list[torch.Tensor] | None:
    """ZeRO-1/2 (`single_partition_of_fp32_groups`) and BF16_Optimizer
    (`fp32_groups_flat_partition`): this rank's flat fp32 partition of each param group.
    None: `optimizer` keeps none."""
    for name in ("single_partition_of_fp32_groups", "fp32_groups_flat_partition"):
        if hasattr(optimizer, name):
            return list(getattr(optimizer, name))
    return None


def zero3_fp32_partitions(optimizer: Any) -> list[torch.Tensor]:
    """ZeRO-3: this rank's flat fp32 partition of each sub-group
    (`fp32_partitioned_groups_flat`)."""
    return list(optimizer.fp32_partitioned_groups_flat)


def unfused_fp32_copies(optimizer: Any) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """FP16_UnfusedOptimizer: (low-precision param, its fp32 copy) of every param, group
    by group (`fp16_groups` beside `fp32_groups`). None: `optimizer` keeps no such copies."""
    if not (hasattr(optimizer, "fp32_groups") and hasattr(optimizer, "fp16_groups")):
        return None
    return [
        (lp, hp)
        for lp_group, hp_group in zip(optimizer.fp16_groups, optimizer.fp32_groups, strict=True)
        for lp, hp in zip(lp_group, hp_group, strict=True)
    ]


def hp_fragment(param: torch.Tensor) -> Any | None:
    """ZeRO-1/2 and BF16_Optimizer: the part of `param` this rank's flat fp32 partition
    holds (`_hp_mapping`: `param_group_index`, `hp_fragment`, `hp_fragment_address`,
    `lp_fragment_address`). None: this rank holds none of it, or it is not trained."""
    return getattr(param, "_hp_mapping", None)


def zero3_partition_rank(optimizer: Any, param: torch.Tensor) -> int:
    """ZeRO-3: which partition of `param` this rank holds (`_get_param_partition_rank`)."""
    return int(optimizer._get_param_partition_rank(param))


def zero3_refresh_partitions(optimizer: Any) -> None:
    """ZeRO-3: set each low-precision partition from its fp32 one, as a step does
    (`_reassign_or_swap_out_partitioned_parameters` of every sub-group)."""
    for sub_group in range(len(optimizer.fp32_partitioned_groups_flat)):
        optimizer._reassign_or_swap_out_partitioned_parameters(sub_group)


# --- the pipeline engine -----------------------------------------------------------------

Handler = Callable[..., Any]


def wrap_pipeline_instructions(engine: Any, wrap: Callable[[type, Handler], Handler]) -> bool:
    """Give `engine` (a PipelineEngine) its own instruction table, each handler `fn` (the
    class's method, called as `fn(engine, **kwargs)`) replaced by `wrap(cls, fn)`
    (`_INSTRUCTION_MAP`). Wrapped twice, the second wrap sees the first. False: `engine`
    runs no pipeline schedule."""
    table = getattr(engine, "_INSTRUCTION_MAP", None)
    if table is None:
        return False
    engine._INSTRUCTION_MAP = {cls: wrap(cls, fn) for cls, fn in dict(table).items()}
    return True


def wrap_loss_reduction(engine: Any, wrap: Callable[[Handler], Handler]) -> None:
    """Replace the pipeline engine's reduction of the step's loss across stages
    (`_aggregate_total_loss`, a bound method) by `wrap(it)`."""
    engine._aggregate_total_loss = wrap(engine._aggregate_total_loss)


# --- process-wide state --------------------------------------------------------------------


def forget_groups() -> None:
    """Forget DeepSpeed's communication state in this process: its backend handle
    (`deepspeed.comm.comm.cdb`) and every group, rank and world size it caches in
    `deepspeed.utils.groups` (module globals `_UPPER_CASE`; string constants kept)."""
    _comm.cdb = None
    for name, value in list(vars(_groups).items()):
        if not (name.startswith("_") and name.isupper()) or callable(value):
            continue
        if isinstance(value, dict):
            setattr(_groups, name, {})
        elif not isinstance(value, str):  # a group, a world size or rank; not a constant
            setattr(_groups, name, None)
