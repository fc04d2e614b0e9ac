"""FLOP accounting, device peak table, MFU and the NVML sampler. No Ray, no GPU needed."""

from __future__ import annotations

import logging
import sys
import types
import warnings

import pytest
import torch

from spotline.config import GptModelSpec, load_spec
from spotline.metrics import gpu
from spotline.metrics.mfu import (
    DEVICE_PEAK_FLOPS,
    measure_matmul_flops,
    mfu,
    model_flops_per_token,
    peak_flops,
)
from spotline.models import build_sequential, model_def
from spotline.models.gpt import flops_per_token

pytestmark = pytest.mark.unit

SMALL = GptModelSpec(n_layers=2, d_model=64, n_heads=4, seq_len=128)
GPT2_SMALL = GptModelSpec(n_layers=12, d_model=768, n_heads=12, seq_len=1024)


# --- FLOPs per token, by hand ---------------------------------------------------------


def test_small_model_flops_by_hand() -> None:
    # d=64, T=128, L=2, V=256.  d^2 = 4096.
    # per block forward: qkv 2*64*192 = 24576, proj 2*64*64 = 8192,
    #   MLP 2*64*256*2 = 65536, attention 2*2*128*64 = 32768  -> 131072
    # 2 blocks -> 262144; head 2*64*256 = 32768; forward = 294912
    # training = 3 * 294912 = 884736
    # check via 6N + 12LTd: N_matmul = 2*12*4096 + 256*64 = 98304 + 16384 = 114688,
    #   6N = 688128, 12*2*128*64 = 196608, sum = 884736
    assert flops_per_token(SMALL, 256) == 884736
    spec = load_spec(None, {"model": SMALL.model_dump()})
    assert model_flops_per_token(spec) == 884736


def test_gpt2_small_flops_by_hand() -> None:
    # d=768, T=1024, L=12, V=256.  d^2 = 589824.
    # per block forward: 24*d^2 = 14155776, attention 4*1024*768 = 3145728 -> 17301504
    # 12 blocks -> 207618048; head 2*768*256 = 393216; forward = 208011264
    # training = 3 * 208011264 = 624033792
    # check via 6N + 12LTd: N_matmul = 12*12*589824 + 256*768 = 84934656 + 196608
    #   = 85131264, 6N = 510787584, 12*12*1024*768 = 113246208, sum = 624033792
    assert flops_per_token(GPT2_SMALL, 256) == 624033792


def test_flops_match_torch_flop_counter_on_the_real_model() -> None:
    """Independent check: torch's FlopCounterMode on the actual GPT. The math SDPA backend
    runs attention as full (unmasked-size) matmuls, the same no-causal-discount convention."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    spec = load_spec(None, {"model": SMALL.model_dump(), "train.seed": 0})
    md = model_def(spec)
    model = build_sequential(md)
    batch = 3
    idx = torch.randint(0, 256, (batch, SMALL.seq_len))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(idx).float().sum().backward()
    assert counter.get_total_flops() / (batch * SMALL.seq_len) == md.flops_per_token


# --- peak table -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "dtype", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("NVIDIA H100 NVL", "bf16", 835e12),
        ("NVIDIA H200", "bf16", 989e12),
        ("NVIDIA H200", torch.bfloat16, 989e12),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
        ("NVIDIA A100-PCIE-40GB", "fp16", 312e12),
        ("NVIDIA A100 80GB PCIe", "float16", 312e12),
        ("nvidia a100-sxm4-40gb", "fp32", 19.5e12),
        ("NVIDIA A10", "bf16", 125e12),
        ("NVIDIA L4", "bf16", 121e12),
        ("NVIDIA L40S", "bf16", 362.05e12),
        ("Tesla V100-SXM2-16GB", "fp16", 125e12),
        ("Tesla V100-PCIE-32GB", "fp16", 112e12),
        ("Tesla T4", "fp16", 65e12),
        ("Tesla T4", "fp32", 8.1e12),
    ],
)
def test_peak_lookup(name: str, dtype: str, expected: float) -> None:
    assert peak_flops(name, dtype) == expected


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("NVIDIA GeForce RTX 4090", "bf16"),  # unknown device
        ("NVIDIA A10G", "bf16"),  # must not fall back to the A10's figure
        ("NVIDIA B200", "bf16"),
        ("cpu", "fp32"),
        ("", "bf16"),
        ("Tesla T4", "bf16"),  # Turing has no bf16
        ("Tesla V100-SXM2-16GB", "bf16"),
        ("NVIDIA H100 80GB HBM3", "int8"),  # dtype not in the table
    ],
)
def test_peak_lookup_unknown_is_none(name: str, dtype: str) -> None:
    assert peak_flops(name, dtype) is None


def test_peak_table_is_dense_and_ordered() -> None:
    for peaks in DEVICE_PEAK_FLOPS.values():
        for value in peaks.values():
            assert 1e12 < value < 2e15  # dense per-GPU figures, not sparse or per-node
    assert peak_flops("NVIDIA A100-SXM4-80GB", "bf16") != peak_flops("NVIDIA A10", "bf16")
    assert peak_flops("NVIDIA GH200 480GB", "bf16") == 989e12


# --- MFU ------------------------------------------------------------------------------


def test_mfu_arithmetic() -> None:
    # 400,000 tok/s * 624,033,792 FLOP/tok = 2.496135168e14 FLOP/s over 8 * 312e12
    # = 2.496e15 -> 0.1000054154
    value = mfu(400_000, 624_033_792, n_devices=8, peak_per_device=312e12)
    assert value == pytest.approx(2.496135168e14 / 2.496e15)
    assert value == pytest.approx(0.10000541538, rel=1e-9)
    assert mfu(1000, 1e9, 1, 1e12) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        mfu(1000, 1e9, 0, 1e12)


def test_measure_matmul_flops() -> None:
    peak = measure_matmul_flops(n=128, repeats=3)
    assert peak > 1e8
    before = torch.get_num_threads()
    assert measure_matmul_flops(n=64, repeats=2, threads=1) > 1e8
    assert torch.get_num_threads() == before


# --- NVML sampler ---------------------------------------------------------------------


@pytest.fixture
def fresh_nvml_cache():
    gpu._reset_cache()
    yield
    gpu._reset_cache()


def test_gpu_samples_empty_without_driver(fresh_nvml_cache, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gpu.gpu_samples() == []
        assert gpu.gpu_samples() == []  # cached failure
    assert caplog.records == []


def test_gpu_samples_empty_without_pynvml(fresh_nvml_cache, monkeypatch, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` -> ImportError
    assert gpu.gpu_samples() == []
    assert caplog.records == []


class _NVMLError(Exception):
    pass


def _fake_pynvml(count: int, init_calls: list[int]) -> types.ModuleType:
    m = types.ModuleType("pynvml")
    m.NVMLError = _NVMLError
    m.NVML_CLOCK_SM = 1

    def init() -> None:
        init_calls.append(1)

    def power(h: int) -> int:
        if h == 1:
            raise _NVMLError("not supported")
        return 250_000  # mW

    m.nvmlInit = init
    m.nvmlDeviceGetCount = lambda: count

    def by_index(i: int) -> int:
        if not 0 <= i < count:
            raise _NVMLError("invalid argument")
        return i

    def by_uuid(uuid: bytes) -> int:  # "GPU-<index>"
        return by_index(int(uuid.decode().removeprefix("GPU-")))

    m.nvmlDeviceGetHandleByIndex = by_index
    m.nvmlDeviceGetHandleByUUID = by_uuid
    m.nvmlDeviceGetIndex = lambda h: h
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H200" if h == 0 else "NVIDIA H200"
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=87, memory=40)
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        used=10 * 2**30, total=141 * 2**30, free=131 * 2**30
    )
    m.nvmlDeviceGetClockInfo = lambda h, kind: 1980
    m.nvmlDeviceGetPowerUsage = power
    return m


def test_gpu_samples_fields_and_per_field_errors(fresh_nvml_cache, monkeypatch) -> None:
    init_calls: list[int] = []
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(2, init_calls))
    samples = gpu.gpu_samples()
    assert samples[0] == {
        "index": 0,
        "name": "NVIDIA H200",
        "utilization_pct": 87.0,
        "memory_used_bytes": 10 * 2**30,
        "memory_total_bytes": 141 * 2**30,
        "sm_clock_mhz": 1980,
        "power_w": 250.0,
    }
    assert samples[1]["index"] == 1 and samples[1]["name"] == "NVIDIA H200"
    assert "power_w" not in samples[1]  # NVMLError on that field: omitted, the rest kept
    assert samples[1]["sm_clock_mhz"] == 1980
    gpu.gpu_samples()
    assert init_calls == [1]  # NVML initialised once


def test_gpu_samples_zero_devices(fresh_nvml_cache, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(0, []))
    assert gpu.gpu_samples() == []


def test_nvml_target_is_the_device_cuda_numbers_local_index():
    t = gpu.nvml_target
    assert t(None, 2) == ("index", 2)  # nothing hidden: CUDA's numbering is NVML's
    assert t("3,1,5", 0) == ("index", 3) and t("3,1,5", 2) == ("index", 5)
    assert t("GPU-aa,GPU-bb", 1) == ("uuid", "GPU-bb")  # Ray may list UUIDs
    assert t("MIG-cc", 0) == ("uuid", "MIG-cc")
    assert t("", 0) is None  # a CPU group hides every GPU
    assert t("2", 1) is None and t(None, -1) is None
    assert t("0,-1,2", 0) == ("index", 0) and t("0,-1,2", 1) is None  # CUDA stops there
    assert t("0,-1,2", 2) is None


def test_a_rank_samples_only_the_gpu_it_drives(fresh_nvml_cache, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(4, []))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    (own,) = gpu.gpu_samples(1)
    assert own["index"] == 3 and own["name"] == "NVIDIA H200"  # the node's numbering
    assert gpu.gpu_samples(2) == []  # no cuda:2 in this process
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1,GPU-0")
    assert [s["index"] for s in gpu.gpu_samples(0)] == [1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    assert gpu.gpu_samples(0) == []  # NVML has no such device
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu.gpu_samples(0) == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert [s["index"] for s in gpu.gpu_samples(2)] == [2]
    assert [s["index"] for s in gpu.gpu_samples()] == [0, 1, 2, 3]  # the whole node


def test_each_rank_exports_its_own_gpu_under_its_labels(fresh_nvml_cache, monkeypatch) -> None:
    from spotline.metrics.prometheus import export_gpu_samples

    class Recorded:
        def __init__(self) -> None:
            self.sets: list[tuple[str, dict]] = []

        def set(self, name: str, value, **tags) -> None:
            if value is not None:
                self.sets.append((name, tags))

    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(4, []))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    m = Recorded()
    export_gpu_samples(m, 1, 0, 2)
    assert {tuple(tags.items()) for _, tags in m.sets} == {
        (("stage", 1), ("replica", 0), ("gpu", 2))
    }
    assert len(m.sets) == 4  # utilisation, memory, clock, power of that one GPU
    m = Recorded()
    export_gpu_samples(m, 0, 0, None)  # a rank that drives no GPU
    assert m.sets == []
