"""How a rank's parameters and state use its device: the optimizer's kernel and the
host copies a checkpoint takes. What runs only on CUDA is tested where CUDA exists."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from spotline.config import load_spec
from spotline.train.trainer import build_optimizer, training_device

pytestmark = pytest.mark.unit


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))


def test_adamw_is_fused_where_the_parameters_train_on_a_gpu():
    spec = load_spec(None, {"train.weight_decay": 0.1})
    cpu = build_optimizer(_model(), spec)
    assert not cpu.defaults["fused"] and not any(g["fused"] for g in cpu.param_groups)
    assert build_optimizer(_model(), spec, device="cpu").defaults["fused"] is None
    gpu = build_optimizer(_model(), spec, device="gpu")
    assert gpu.defaults["fused"] is True and all(g["fused"] for g in gpu.param_groups)
    # Same groups either way: decay on the matrices only.
    assert [g["weight_decay"] for g in gpu.param_groups] == [0.1, 0.0]
    assert [len(g["params"]) for g in gpu.param_groups] == [1, 3]


def test_the_training_device_follows_the_process_groups_backend():
    assert not dist.is_initialized()
    assert training_device() == "cpu"  # no group yet
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert training_device() == "cpu"  # a gloo group trains on the host
    finally:
        dist.destroy_process_group()
