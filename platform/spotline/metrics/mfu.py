"""FLOP accounting, device peaks, and model FLOPs utilisation (MFU).

Conventions (those of PaLM, Chowdhery et al. 2022, appendix B, and Megatron-LM, Narayanan
et al. 2021, section 5.1), which every model provider's `flops_per_token` follows:

* Only matrix multiplications count, each as 2*m*n*k FLOPs (one multiply and one add per
  term). Norms, activations, softmax, dropout, residual and bias adds and the loss are
  left out; embedding lookups are gathers and cost 0.
* Attention is counted over the full sequence: the causal mask is not discounted, i.e.
  every query is charged for all seq_len keys, although half the score matrix is masked.
  Numbers are therefore comparable with published MFU figures, not a count of the
  multiplications a causal kernel actually performs.
* Training = forward + backward, with the backward pass twice the forward (one matmul for
  the gradient of the input, one for the gradient of the weight), so 3x forward.

For the built-in models (see `spotline.models.gpt` and `spotline.models.llama`):
  GPT:   6*N + 12*L*T*d, N = L*12*d^2 + V*d
  Llama: 6*N + 12*L*T*d, N = L*(2*d^2 + 2*d*kv*hd + 3*d*ffn) + d*V (GQA, SwiGLU)

MFU = achieved model FLOP/s / peak FLOP/s. HFU counts the hardware's FLOPs: with
parallel.activation_checkpointing, each recomputed block runs its forward (a third of
its training FLOPs) once more; without it HFU = MFU.
"""

from __future__ import annotations

import re
import time

import torch

from spotline.config.schema import JobSpec


def model_flops_per_token(spec: JobSpec) -> float:
    """Training FLOPs per token of the job's model, from its provider."""
    from spotline.models import model_def

    return float(model_def(spec).flops_per_token)


def hardware_flops_per_token(spec: JobSpec) -> float:
    """`model_flops_per_token` plus the forward of every block that
    parallel.activation_checkpointing recomputes in the backward (1/3 of its share)."""
    from spotline.models import model_def
    from spotline.models.flops import layer_flops_per_token

    every = spec.parallel.activation_checkpointing
    model = model_def(spec) if every else None
    total = model_flops_per_token(spec)
    if model is None:
        return total
    per_layer = layer_flops_per_token(spec, model)
    blocks = [i for i, ld in enumerate(model.layers) if ld.cls is model.block_class]
    return total + sum(per_layer[i] / 3 for n, i in enumerate(blocks) if n % every == 0)


# --- device peaks --------------------------------------------------------------------

# Dense peak FLOP/s per device (no 2:4 structured sparsity: NVIDIA datasheets print the
# sparse figure first for Ampere and later, the dense one is half). "bf16"/"fp16" are the
# tensor-core peaks; "fp32" is the non-tensor (CUDA core) FP32 peak, which is what fp32
# matmuls reach in PyTorch by default (TF32 matmul is off unless
# torch.backends.cuda.matmul.allow_tf32 / set_float32_matmul_precision enable it).
# A dtype a device does not support (bf16 before Ampere) is absent and looks up as None.
#
# Entries are (pattern, peaks); patterns are matched case-insensitively with word
# boundaries against names as torch.cuda.get_device_name() / nvmlDeviceGetName() print
# them, most specific first ("H100 NVL" and "H100 PCIe" before plain "H100").
#
# Not listed, so they look up as None rather than a guess: A10G (AWS's variant of the A10;
# NVIDIA publishes no datasheet for it, and it is clocked lower than the A10), B200/GB200
# (figures differ between HGX and DGX configurations), consumer GeForce/RTX cards.
DEVICE_PEAK_FLOPS: dict[str, dict[str, float]] = {
    # H200 datasheet: H200 SXM BF16/FP16 tensor 1,979 TFLOPS sparse -> 989 dense; FP32 67.
    "H200 NVL": {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12},  # 1,671 sparse; FP32 60
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    # GH200 datasheet: Hopper GPU BF16/FP16 1,979 TFLOPS sparse -> 989 dense; FP32 67.
    "GH200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    # H100 datasheet: SXM BF16/FP16 1,979 sparse -> 989 dense, FP32 67;
    # PCIe 1,513 sparse -> 756 dense, FP32 51; NVL 1,671 sparse -> 835 dense, FP32 60.
    "H100 NVL": {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},  # SXM ("H100 80GB HBM3")
    # A100 datasheet (SXM and PCIe, 40/80 GB): BF16/FP16 tensor 312 dense, FP32 19.5.
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    # A30 datasheet: BF16/FP16 tensor 165 dense (330 sparse), FP32 10.3.
    "A30": {"bf16": 165e12, "fp16": 165e12, "fp32": 10.3e12},
    # A10 datasheet: BF16/FP16 tensor 125 dense (250 sparse), FP32 31.2. Not the A10G.
    "A10": {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12},
    # L40S datasheet: BF16/FP16 tensor 362.05 dense (733 sparse), FP32 91.6.
    "L40S": {"bf16": 362.05e12, "fp16": 362.05e12, "fp32": 91.6e12},
    # L40 datasheet: BF16/FP16 tensor 181.05 dense (362.1 sparse), FP32 90.5.
    "L40": {"bf16": 181.05e12, "fp16": 181.05e12, "fp32": 90.5e12},
    # L4 datasheet: BF16/FP16 tensor 242 sparse -> 121 dense; FP32 30.3.
    "L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12},
    # V100 datasheet: tensor (FP16) SXM2 125, PCIe 112, V100S PCIe 130; FP32 15.7 / 14 /
    # 16.4. Volta has no bf16.
    "V100S": {"fp16": 130e12, "fp32": 16.4e12},
    "V100 PCIe": {"fp16": 112e12, "fp32": 14e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},  # SXM2
    # T4 datasheet: mixed-precision (FP16) tensor 65, FP32 8.1. Turing has no bf16.
    "T4": {"fp16": 65e12, "fp32": 8.1e12},
}

# Regexes for the table keys, in lookup order (the dict order above: most specific first).
# A key's words may be joined by a space, '-' or '_' ("A100-SXM4", "V100-PCIE-16GB"); \b on
# both sides keeps "A10" from matching "A100"/"A10G" and "H200" from matching "GH200".
_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\b" + r"[\s_-]+".join(map(re.escape, key.split())) + r"\b", re.I), key)
    for key in DEVICE_PEAK_FLOPS
]

_DTYPE_ALIASES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
}


def _dtype_key(dtype: str | torch.dtype) -> str | None:
    name = str(dtype).lower().strip()
    name = name.removeprefix("torch.")
    return _DTYPE_ALIASES.get(name)


def device_key(device_name: str) -> str | None:
    """The DEVICE_PEAK_FLOPS key a device name maps to, or None if it is not in the table."""
    for pattern, key in _PATTERNS:
        if pattern.search(device_name):
            return key
    return None


def peak_flops(device_name: str, dtype: str | torch.dtype) -> float | None:
    """Dense peak FLOP/s of `device_name` in `dtype`, or None when unknown.

    `device_name` is what torch.cuda.get_device_name() or pynvml report, e.g.
    "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB", "Tesla T4"; matched
    case-insensitively, most specific entry first. `dtype` is "bf16", "fp16" or "fp32"
    (also "bfloat16", "float16", "half", "float32", or a torch.dtype). Returns None for
    an unknown device, an unknown dtype, or a dtype the device does not support.
    """
    key = device_key(device_name)
    dt = _dtype_key(dtype)
    if key is None or dt is None:
        return None
    return DEVICE_PEAK_FLOPS[key].get(dt)


def measure_matmul_flops(
    dtype: torch.dtype = torch.float32,
    n: int = 1024,
    repeats: int = 5,
    threads: int | None = None,
    device: str | torch.device = "cpu",
) -> float:
    """Measured FLOP/s of an n x n x n matmul on `device`: the stand-in peak on CPU, and
    how fast a worker's device is against its peers (the balanced stage partition).

    One warm-up matmul, then the best (fastest) of `repeats` timed ones, each counted as
    2*n^3 FLOPs. `threads` sets torch's intra-op thread count for the measurement (and
    restores it afterwards); None uses the current setting, which should match the
    training process's so the figure is what the run could reach.
    """
    if n < 1 or repeats < 1:
        raise ValueError(f"n ({n}) and repeats ({repeats}) must be >= 1")
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    prev_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
        b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
        out = torch.empty(n, n, dtype=dtype, device=device)
        torch.mm(a, b, out=out)  # warm-up: thread pool, kernel selection, page faults
        sync()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b, out=out)
            sync()
            best = min(best, time.perf_counter() - t0)
    finally:
        if threads is not None:
            torch.set_num_threads(prev_threads)
    return 2.0 * n**3 / max(best, 1e-12)


def mfu(
    tokens_per_s: float, flops_per_token: float, n_devices: int, peak_per_device: float
) -> float:
    """Model FLOPs utilisation: tokens_per_s * flops_per_token / (n_devices * peak_per_device).

    `tokens_per_s` is the throughput of the whole job (all devices); pass
    `model_flops_per_token` for MFU or `hardware_flops_per_token` for HFU.
    """
    if n_devices <= 0 or peak_per_device <= 0:
        raise ValueError(
            f"n_devices ({n_devices}) and peak_per_device ({peak_per_device}) must be > 0"
        )
    return tokens_per_s * flops_per_token / (n_devices * peak_per_device)


def device_peak(precision: str, threads: int | None = None) -> tuple[str, float | None]:
    """This process's device and its peak FLOP/s per device, the denominator of MFU.

    A GPU's peak comes from `DEVICE_PEAK_FLOPS` (None when the device is not in the
    table: then MFU is not reported rather than guessed). On CPU it is a matmul this
    process measures, with its own thread budget, at start-up.
    """
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        return name, peak_flops(name, "bf16" if precision == "bf16" else "fp32")
    return "cpu", measure_matmul_flops(n=512, repeats=3, threads=threads)
