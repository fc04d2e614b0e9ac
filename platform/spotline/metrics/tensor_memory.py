"""Peak tensor memory of one rank, measured, on any device.

On a GPU, the CUDA caching allocator keeps the figure (`torch.cuda.max_memory_allocated`).
On CPU nothing does, so `TensorMemory` counts it: the bytes of every tensor storage
alive when it starts (found through the garbage collector, each storage once), plus
each storage a tensor operation allocates inside the region, minus each one freed.
The peak is the largest that sum reached. Storage the allocator keeps for reuse and
memory outside tensors (the interpreter, libraries) are not counted, as on a GPU.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from typing import Any

import torch

from spotline.compat.torch import TorchDispatchMode, tree_leaves


def _live_storages(device: str) -> dict[int, int]:
    out: dict[int, int] = {}
    with warnings.catch_warnings():  # some objects warn when their type is asked
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        if obj.device.type == device:
            try:
                s = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):  # meta, sparse, wrapper subclasses
                continue
            out.setdefault(s.data_ptr(), s.nbytes())
    return out


class TensorMemory(TorchDispatchMode):
    """`with TensorMemory() as m: step()`, then `m.peak_bytes` and `m.start_bytes`."""

    def __init__(self, device: str = "cpu"):
        super().__init__()
        self.device = device
        self._live: dict[int, int] = {}
        self.start_bytes = 0
        self.now_bytes = 0
        self.peak_bytes = 0

    def __enter__(self) -> TensorMemory:
        self._live = _live_storages(self.device)
        self.start_bytes = self.now_bytes = self.peak_bytes = sum(self._live.values())
        return super().__enter__()

    def _freed(self, ptr: int) -> None:
        self.now_bytes -= self._live.pop(ptr, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != self.device:
                continue
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr in self._live or s.nbytes() == 0:
                continue
            self._live[ptr] = s.nbytes()
            self.now_bytes += s.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.now_bytes)
            weakref.finalize(s, self._freed, ptr)
        return out


def measure_peak(fn: Any, device: torch.device) -> tuple[Any, int]:
    """(fn(), peak tensor bytes of this process's device while it ran)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        return out, int(torch.cuda.max_memory_allocated(device))
    with TensorMemory(device.type) as m:
        out = fn()
    return out, m.peak_bytes
