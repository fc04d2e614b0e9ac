"""Per-GPU utilisation samples from NVML (package nvidia-ml-py, module `pynvml`).

A rank samples the one device it drives (`gpu_samples(local_index)`): the ranks of a
node share its GPUs (CUDA_VISIBLE_DEVICES lists them all), and each exports only its
own under its own labels. Silent where there is nothing to sample: without pynvml,
without an NVIDIA driver, or with no devices, `gpu_samples()` returns [] and logs and
warns nothing, so it can be called unconditionally from a CPU-only worker's metrics loop.
"""

from __future__ import annotations

import os
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


def nvml_target(cuda_visible_devices: str | None, local_index: int) -> tuple[str, int | str] | None:
    """How NVML names the device torch calls cuda:`local_index`: ("index", NVML index)
    or ("uuid", "GPU-..." / "MIG-..."); None when no such device is visible.

    `cuda_visible_devices` is the process's CUDA_VISIBLE_DEVICES, which Ray sets to
    device indices or UUIDs: cuda:i is its i-th entry, and CUDA ignores the entries from
    the first one that names no device on. Unset, cuda:i is NVML's device i (CUDA's
    default order puts the fastest device first; on a node of identical GPUs that is
    the PCI bus order NVML numbers by). Empty, no device is visible.
    """
    if cuda_visible_devices is None:
        return ("index", local_index) if local_index >= 0 else None
    visible: list[tuple[str, int | str]] = []
    for entry in cuda_visible_devices.split(","):
        entry = entry.strip()
        if entry.isdigit():
            visible.append(("index", int(entry)))
        elif entry.startswith(("GPU-", "MIG-")):
            visible.append(("uuid", entry))
        else:
            break
    return visible[local_index] if 0 <= local_index < len(visible) else None


def _handle(nvml: Any, target: tuple[str, int | str]) -> Any:
    """The NVML handle of a `nvml_target`, or _UNSET."""
    kind, key = target
    if kind == "uuid":
        return _field(lambda: nvml.nvmlDeviceGetHandleByUUID(str(key).encode()))
    return _field(lambda: nvml.nvmlDeviceGetHandleByIndex(key))


def _sample(nvml: Any, index: int, handle: Any) -> dict[str, Any]:
    sample: dict[str, Any] = {"index": index}
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


def gpu_samples(local_index: int | None = None) -> list[dict[str, Any]]:
    """One dict per NVIDIA device, in NVML index order; with `local_index`, only the
    device this process calls cuda:`local_index` (`nvml_target` of its
    CUDA_VISIBLE_DEVICES), or none when that device is not visible.

    Keys: index (NVML's, the node's numbering), name, utilization_pct (GPU busy %, last
    sample period), memory_used_bytes, memory_total_bytes, sm_clock_mhz, power_w. A
    field NVML cannot read for a device (not supported, no permission) is omitted;
    `index` is always present. Returns [] when pynvml is not installed, NVML fails to
    initialise (no driver), or there are no devices; it never raises, logs or warns.
    """
    nvml = _init_nvml()
    if nvml is None:
        return []
    if local_index is not None:
        target = nvml_target(os.environ.get("CUDA_VISIBLE_DEVICES"), local_index)
        handle = _UNSET if target is None else _handle(nvml, target)
        if handle is _UNSET:
            return []
        kind, key = target
        index = key if kind == "index" else _field(lambda: int(nvml.nvmlDeviceGetIndex(handle)))
        return [_sample(nvml, local_index if index is _UNSET else index, handle)]
    count = _field(nvml.nvmlDeviceGetCount)
    if count is _UNSET or not count:
        return []
    return [_sample(nvml, i, _handle(nvml, ("index", i))) for i in range(int(count))]
