"""Node-local directories a job writes: checkpoint staging, restore and backfill caches.

Checked in the driver by the preflight (for its own node) and by every worker when it
starts (for its node), so an unwritable or full disk fails before the first step with
the field to fix, not at the first checkpoint with a bare FileNotFoundError.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from spotline.config.loader import SpecError

GB = 1e9


def check_local_dir(path: str | os.PathLike[str], field: str, need_bytes: int = 0) -> None:
    """`path` exists (or can be created), this user can write there, and it has
    `need_bytes` free. Raises SpecError naming `field`."""
    root = Path(path).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".spotline-probe-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"probe")
        probe.unlink()
    except OSError as e:
        raise SpecError(
            f"{field}: {root} is not a writable directory ({e.strerror or e}); point {field} "
            "at a directory this user can write on every node, or fix its permissions"
        ) from None
    free = shutil.disk_usage(root).free
    if free < need_bytes:
        raise SpecError(
            f"{field}: {root} has {free / GB:.2f} GB free and one checkpoint of this job "
            f"takes about {need_bytes / GB:.2f} GB; free space there or point {field} at a "
            "larger disk"
        )
