"""Per-GPU utilisation samples from NVML (package nvidia-ml-py, module `pynvml`).

Silent where there is nothing to sample: without pynvml, without an NVIDIA driver, or
with no devices, `gpu_samples()` returns [] and logs and warns nothing, so it can be
called unconditionally from a CPU-only worker's metrics loop.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

_UNSET = object()
_lock = threading.Lock()
# The pynvml module after a successful nvmlInit, None after a failed one (import error or
# no driver), _UNSET before the first attempt. Either outcome is cached for the process.
_nvml: Any = _UNSET


def _reset_cache() -> None:
    """Forget the cached NVML initialisation, so the next call tries again (for tests)."""
    global _nvml
    with _lock:
        _nvml = _UNSET


def _init_nvml() -> Any:
    """pynvml, initialised once per process; None when unavailable."""
    global _nvml
    if _nvml is not _UNSET:
        return _nvml
    with _lock:
        if _nvml is _UNSET:
            try:
                with warnings.catch_warnings():
                    # The deprecated `pynvml` wrapper package warns on import.
                    warnings.simplefilter("ignore")
                    import pynvml

                pynvml.nvmlInit()
                _nvml = pynvml
            except Exception:  # ImportError, NVMLError (no driver / library), anything else
                _nvml = None
    return _nvml


def _field(read: Callable[[], Any]) -> Any:
    """read(), or _UNSET when NVML cannot answer for this device (field omitted)."""
    try:
        return read()
    except Exception:  # NVMLError_NotSupported, NoPermission, GpuIsLost, ...
        return _UNSET


def _sample(nvml: Any, index: int) -> dict[str, Any]:
    sample: dict[str, Any] = {"index": index}
    handle = _field(lambda: nvml.nvmlDeviceGetHandleByIndex(index))
    if handle is _UNSET:
        return sample

    def name() -> str:
        raw = nvml.nvmlDeviceGetName(handle)
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def memory() -> Any:
        return nvml.nvmlDeviceGetMemoryInfo(handle)

    mem = _field(memory)
    fields: dict[str, Callable[[], Any]] = {
        "name": name,
        "utilization_pct": lambda: float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
        "memory_used_bytes": lambda: int(mem.used),
        "memory_total_bytes": lambda: int(mem.total),
        "sm_clock_mhz": lambda: int(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
        "power_w": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,  # reported in mW
    }
    for key, read in fields.items():
        if key.startswith("memory_") and mem is _UNSET:
            continue
        value = _field(read)
        if value is not _UNSET:
            sample[key] = value
    return sample


def gpu_samples() -> list[dict[str, Any]]:
    """One dict per NVIDIA device, in NVML index order.

    Keys: index, name, utilization_pct (GPU busy %, last sample period), memory_used_bytes,
    memory_total_bytes, sm_clock_mhz, power_w. A field NVML cannot read for a device
    (not supported, no permission) is omitted; `index` is always present. Returns [] when
    pynvml is not installed, NVML fails to initialise (no driver), or there are no devices;
    it never raises, logs or warns.
    """
    nvml = _init_nvml()
    if nvml is None:
        return []
    count = _field(nvml.nvmlDeviceGetCount)
    if count is _UNSET or not count:
        return []
    return [_sample(nvml, i) for i in range(int(count))]
