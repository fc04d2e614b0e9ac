"""How a rank's parameters and state use its device: the optimizer's kernel and the
host copies a checkpoint takes. What runs only on CUDA is tested where CUDA exists."""

from __future__ import annotations

import pytest
import torch

from spotline.config import load_spec
from spotline.train.engine import HostCopier
from spotline.train.trainer import build_optimizer

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


# --- host copies of a checkpoint's state ---------------------------------------------


def test_a_cpu_host_copy_is_a_flat_copy_that_later_steps_do_not_touch():
    host = HostCopier()
    src = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    col = src.t()  # not contiguous
    a, b = host.copy(src), host.copy(col)
    host.wait()
    assert a.shape == (12,) and b.shape == (12,) and b.is_contiguous()
    assert torch.equal(a, torch.arange(12.0)) and torch.equal(b, col.reshape(-1))
    src.add_(100.0)  # the next step updates the parameters in place
    assert torch.equal(a, torch.arange(12.0)) and torch.equal(b, src.t().reshape(-1) - 100)
    assert a.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
    assert not a.is_pinned()  # plain host memory on CPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_host_copy_is_pinned_and_sees_the_writes_queued_before_it():
    host = HostCopier()
    src = torch.zeros(1 << 22, device="cuda")
    for _ in range(20):  # queue work on the current stream that the copy must wait for
        src.add_(1.0)
    out = host.copy(src.view(1024, -1).t())
    host.wait()
    assert out.is_pinned() and out.device.type == "cpu" and out.shape == (1 << 22,)
    assert torch.all(out == 20.0)
    src.add_(1.0)
    torch.cuda.synchronize()
    assert torch.all(out == 20.0)
