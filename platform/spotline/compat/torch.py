"""torch's private names that Spotline uses: one function per need, checked at import."""

from __future__ import annotations

from datetime import timedelta
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

TorchDispatchMode = _torch.attribute("torch.utils._python_dispatch", "TorchDispatchMode")
"""The base class of a mode that sees every tensor operation (torch's `__torch_dispatch__`)."""

tree_leaves = _torch.attribute("torch.utils._pytree", "tree_leaves")
"""`tree_leaves(tree)`: the leaves of nested lists, tuples and dicts (torch's pytree)."""


def abort_process_groups() -> bool:
    """Abort every process group of this process (NCCL: `ncclCommAbort` of each
    communicator, grouped so that one abort cannot wait on another) and forget them, so
    that `init_process_group` can start a new default group. False: there was none."""
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
