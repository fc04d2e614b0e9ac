"""torch's private names that Spotline uses: one function per need, checked at import."""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.distributed import distributed_c10d as _c10d

from spotline.compat import Pinned

PIN = "torch==2.13.0"  # pyproject.toml's
_torch = Pinned("torch", torch.__version__, PIN)

_torch.module(
    _c10d.__name__,
    "_abort_process_group",
    "_get_default_store",
    "default_pg_timeout",
    "default_pg_nccl_timeout",
)
_c10d_ext = _torch.module("torch._C._distributed_c10d", "_dump_fr_trace_json")
# Read from source, not imported: importing it loads setuptools (about 85 ms), which a
# process that builds no op never needs. `extension_build_root` follows the layout of
# `_get_build_directory`'s root.
_torch.defined("torch.utils.cpp_extension", "get_default_build_root", "_get_build_directory")

TorchDispatchMode = _torch.attribute("torch.utils._python_dispatch", "TorchDispatchMode")
"""The base class of a mode that sees every tensor operation (torch's `__torch_dispatch__`)."""

tree_leaves = _torch.attribute("torch.utils._pytree", "tree_leaves")
"""`tree_leaves(tree)`: the leaves of nested lists, tuples and dicts (torch's pytree)."""


def abort_process_groups() -> bool:
    """Abort every process group of this process (NCCL: `ncclCommAbort` of each
    communicator, grouped so that one abort cannot wait on another) and forget them, so
    that `init_process_group` can start a new default group. False: there was none.
    torch documents it for TORCH_NCCL_ASYNC_ERROR_HANDLING=0, which a rank sets
    (`spotline.train.comms.settle_nccl_error_handling`); it may block, so ranks call it
    under a watchdog, on a thread of its own."""
    if not _c10d.is_initialized():
        return False
    _c10d._abort_process_group()
    return True


def default_store() -> Any:
    """The store the default process group was initialised with."""
    return _c10d._get_default_store()


def set_default_group_timeout(timeout: timedelta) -> None:
    """Make every process group created from now on without a timeout of its own wait
    `timeout`, on gloo and NCCL alike (torch's defaults: 30 minutes for gloo, 10 for
    NCCL, whatever the default group was given)."""
    _c10d.default_pg_timeout = timeout
    _c10d.default_pg_nccl_timeout = timeout


def flight_record_json() -> bytes:
    """torch's NCCL flight recorder of this process as JSON: every collective it kept,
    finished or not (empty where no NCCL communicator recorded any)."""
    return bytes(_c10d_ext._dump_fr_trace_json(includeCollectives=True, onlyActive=False))


def extension_build_root() -> Path:
    """Where torch builds and caches JIT-compiled extensions (DeepSpeed's ops) for this
    Python and accelerator: `$TORCH_EXTENSIONS_DIR`, else torch's default root and a
    folder per Python version and accelerator (`py311_cpu`, `py311_cu128`)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def stale_extension_locks(quiet_s: float, now: float | None = None) -> list[tuple[Path, float]]:
    """The build locks under `extension_build_root()` that a killed build left, each
    with how long its build directory has been untouched.

    torch serialises an extension's build with a `lock` file in its build directory:
    the process that creates it builds, and every other process loading the extension
    polls until the file is gone. The file names no owner, so a build killed before it
    removes it (a preempted or SIGKILLed rank) leaves every later load of that op on
    the node waiting forever. A lock is stale when neither it nor any file beside it
    changed for `quiet_s`: a live build writes its objects and ninja's log as it goes."""
    now = time.time() if now is None else now
    stale = []
    for lock in sorted(extension_build_root().glob("*/lock")):
        try:
            newest = max(f.stat().st_mtime for f in lock.parent.iterdir())
        except (FileNotFoundError, ValueError):  # removed meanwhile: a build finished
            continue
        if now - newest >= quiet_s:
            stale.append((lock, now - newest))
    return stale
