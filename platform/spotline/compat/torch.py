"""torch's private names that Spotline uses: one function per need, checked at import."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import distributed_c10d as _c10d

_PIN = "torch==2.13.0"


def _private(name: str) -> Any:
    found = getattr(_c10d, name, None)
    if found is None:
        raise ImportError(
            f"torch {torch.__version__} has no torch.distributed.distributed_c10d.{name}, "
            f"which Spotline needs; install the pinned {_PIN} (pyproject.toml)"
        )
    return found


_abort_process_group = _private("_abort_process_group")
_get_default_store = _private("_get_default_store")


def abort_process_groups() -> bool:
    """Abort every process group of this process (NCCL: `ncclCommAbort` of each
    communicator, grouped so that one abort cannot wait on another) and forget them, so
    that `init_process_group` can start a new default group. False: there was none."""
    if not _c10d.is_initialized():
        return False
    _abort_process_group()
    return True


def default_store() -> Any:
    """The store the default process group was initialised with."""
    return _get_default_store()
