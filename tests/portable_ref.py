"""A reference for the sharded state's tests: full fp32 weights and Adam moments by
parameter name, gathered with a collective (what Spotline's checkpoints held before
they were sharded per rank). Tests compare the sharded save/load against it.

Spotline itself never uses this: its checkpoints are `spotline.train.state`'s. `gather` collects, per pipeline stage, every
parameter's full fp32 master copy and Adam moments (`exp_avg`, `exp_avg_sq`) under its
global name (`<layer index>.<param>`, the same in a PipelineModule and in the pp=1
Sequential). A checkpoint written with D replicas therefore loads with D' != D: each
new rank scatters the full tensors into whatever ZeRO partition it now owns.

Files are safetensors with a JSON header (`spotline.checkpoint.layout`): loading one
can never run code.

`gather` is collective over the data-parallel group: every rank calls it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from spotline.checkpoint.layout import CheckpointFormatError, load_tensors, save_tensors

OPTIM_KEYS = ("exp_avg", "exp_avg_sq")
TENSOR_KINDS = ("param", *OPTIM_KEYS)
STAGE_SUFFIX = ".safetensors"


def _base_optimizer(engine) -> torch.optim.Optimizer:
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)


def _relink(engine) -> None:
    # DeepSpeed links each parameter to its slice of the optimizer state after the
    # first step of the *first* param group only, leaving the other groups' links
    # empty; link again now that every group has state.
    opt = engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def _partitioned(p: torch.nn.Parameter) -> bool:
    return hasattr(p, "_hp_mapping") or hasattr(p, "ds_id")  # ZeRO 1-2 / ZeRO-3


def _full(p: torch.nn.Parameter, key: str | None, base: torch.optim.Optimizer):
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if _partitioned(p):  # collective under ZeRO-3 (an all-gather per parameter)
        v = safe_get_full_fp32_param(p) if key is None else safe_get_full_optimizer_state(p, key)
    else:  # ZeRO-0: the optimizer holds the parameter itself
        v = p.detach() if key is None else base.state.get(p, {}).get(key)
    return None if v is None else v.detach().float().cpu().clone()


def gather(engine) -> dict[str, Any]:
    """This stage's full state (identical on every data-parallel rank of the stage)."""
    _relink(engine)
    base = _base_optimizer(engine)
    params = {
        name: {"param": _full(p, None, base), **{k: _full(p, k, base) for k in OPTIM_KEYS}}
        for name, p in engine.module.named_parameters()
    }
    first = next(iter(base.state.values()), None)
    step = float(first["step"]) if first and "step" in first else None
    return {
        "params": params,
        "adam_step": step,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
    }


def save(state: dict[str, Any], path: Path) -> None:
    """Write one stage's gathered state: tensors as `<name>/<kind>`, the rest as JSON."""
    tensors = {
        f"{name}/{kind}": t
        for name, kinds in state["params"].items()
        for kind, t in kinds.items()
        if t is not None
    }
    meta = {k: v for k, v in state.items() if k != "params"}
    save_tensors(path, tensors, meta)


def load_files(paths: list[Path]) -> dict[str, Any]:
    """Merge the per-stage files of a checkpoint into one state keyed by global name."""
    merged: dict[str, Any] = {"params": {}}
    for path in sorted(paths):
        tensors, meta = load_tensors(path)
        for key, t in tensors.items():
            name, _, kind = key.rpartition("/")
            if kind not in TENSOR_KINDS or not name:
                raise CheckpointFormatError(path, f"unexpected tensor {key!r}")
            merged["params"].setdefault(name, {})[kind] = t
        merged.update(meta)
    return merged


def load(engine, state: dict[str, Any]) -> None:
    """Scatter full tensors into this rank's partitions. Not collective."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    base = _base_optimizer(engine)
    # Adam creates its state lazily at the first step; create it now so the
    # moments have somewhere to go.
    step = torch.tensor(float(state["adam_step"] or 0.0), dtype=torch.float32)
    opt = engine.optimizer
    # ZeRO-3 keeps its flat fp32 partitions out of the base optimizer's param groups
    # between steps; the others keep them in.
    flats = getattr(opt, "fp32_partitioned_groups_flat", None) or [
        flat for group in base.param_groups for flat in group["params"]
    ]
    for flat in flats:
        if not base.state.get(flat):
            base.state[flat] = {
                "step": step.clone(),
                "exp_avg": torch.zeros_like(flat),
                "exp_avg_sq": torch.zeros_like(flat),
            }
    _relink(engine)
    missing = [n for n, _ in engine.module.named_parameters() if n not in state["params"]]
    if missing:
        raise KeyError(f"checkpoint has no state for parameters {missing[:5]}")
    for name, p in engine.module.named_parameters():
        saved = state["params"][name]
        if not hasattr(p, "ds_id"):  # ZeRO-3 rebuilds its partitions from fp32 below
            with torch.no_grad():
                p.data.copy_(saved["param"].to(p.dtype))
        if _partitioned(p):
            safe_set_full_fp32_param(p, saved["param"].to(p.device))
            for k in OPTIM_KEYS:
                safe_set_full_optimizer_state(p, saved[k].to(p.device), k)
        else:
            st = base.state[p]
            for k in OPTIM_KEYS:
                st[k] = saved[k].to(p.device).clone()
    if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3: low-precision copies from fp32
        for sub_group in range(len(opt.fp32_partitioned_groups_flat)):
            opt._reassign_or_swap_out_partitioned_parameters(sub_group)
    if engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.global_steps = state["global_steps"]
    engine.global_samples = state["global_samples"]


def save_reference(trainer, root: Path) -> None:
    """The full state of every stage under root/global_step<N>/spotline/ (collective)."""
    out = Path(root) / f"global_step{trainer.step}" / "spotline"
    out.mkdir(parents=True, exist_ok=True)
    state = gather(trainer.engine)
    if trainer.topo.replica == 0:
        save(state, out / f"stage_{trainer.topo.stage:03d}{STAGE_SUFFIX}")


def load_reference(trainer, root: Path, step: int) -> None:
    files = sorted((Path(root) / f"global_step{step}" / "spotline").glob(f"stage_*{STAGE_SUFFIX}"))
    load(trainer.engine, load_files(files))
    trainer.step = step
    trainer._sync_lr()
