"""Topology-free training state: full fp32 weights and Adam moments, by parameter name.

DeepSpeed's own ZeRO files are sharded by data-parallel rank and load only at the
world size that wrote them. This module gathers, per pipeline stage, every
parameter's full fp32 master copy and Adam moments (`exp_avg`, `exp_avg_sq`) under
its global name (`<layer index>.<param>`, the same in a PipelineModule and in the
pp=1 Sequential), so a checkpoint written with D replicas loads with D' != D: each
new rank scatters the full tensors into whatever ZeRO partition it now owns.

`gather` is collective over the data-parallel group: every rank calls it.
ZeRO-3 is not covered (its parameters themselves are partitioned).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

OPTIM_KEYS = ("exp_avg", "exp_avg_sq")


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
    return hasattr(p, "_hp_mapping")


def _full(p: torch.nn.Parameter, key: str | None, base: torch.optim.Optimizer):
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if _partitioned(p):
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
    step = first["step"].clone() if first and "step" in first else None
    return {
        "params": params,
        "adam_step": step,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
    }


def save(engine, path: Path) -> None:
    torch.save(gather(engine), path)


def load_files(paths: list[Path]) -> dict[str, Any]:
    """Merge the per-stage files of a checkpoint into one state keyed by global name."""
    merged: dict[str, Any] = {"params": {}}
    for path in sorted(paths):
        part = torch.load(path, weights_only=False, map_location="cpu")
        merged["params"].update(part.pop("params"))
        merged.update(part)
    return merged


def load(engine, state: dict[str, Any]) -> None:
    """Scatter full tensors into this rank's partitions. Not collective."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    base = _base_optimizer(engine)
    # Adam creates its state lazily at the first step; create it now so the
    # moments have somewhere to go.
    for group in base.param_groups:
        for flat in group["params"]:
            if not base.state.get(flat):
                base.state[flat] = {
                    "step": state["adam_step"].clone(),
                    "exp_avg": torch.zeros_like(flat),
                    "exp_avg_sq": torch.zeros_like(flat),
                }
    _relink(engine)
    missing = [n for n, _ in engine.module.named_parameters() if n not in state["params"]]
    if missing:
        raise KeyError(f"checkpoint has no state for parameters {missing[:5]}")
    for name, p in engine.module.named_parameters():
        saved = state["params"][name]
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
    if engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.global_steps = state["global_steps"]
    engine.global_samples = state["global_samples"]
