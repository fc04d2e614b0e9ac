"""Reads of a committed step's files: ranged reads (a restoring rank fetches only its
fragments) and the streamed verification of every file against its manifest entry.

Every path read here comes from a manifest or an index, so it goes through
`entry_path` and never leaves its step. A missing file or one whose size or
sha256 differs is a CorruptCheckpointError, which the coordinator's restore treats as
a reason to fall back, never as an outage to retry.
"""

from __future__ import annotations

import hashlib

from spotline.checkpoint.errors import CorruptCheckpointError
from spotline.checkpoint.manifest import FileEntry, Manifest
from spotline.storage import UnsafePathError, join_under
from spotline.storage.checkpoint_root import StepStorage
from spotline.storage.fs import HASH_CHUNK_BYTES


def entry_path(storage: StepStorage, step: int, relpath: str) -> str:
    """Where a file a manifest or index names lies, never outside the step (on a local
    root, not through a symlink either): CorruptCheckpointError naming it otherwise."""
    try:
        return join_under(storage.step_path(step), relpath, local=storage.is_local)
    except UnsafePathError as e:
        raise CorruptCheckpointError(
            step, str(relpath), f"leaves the step directory ({e.why})", uri=storage.uri
        ) from None


def read_range(storage: StepStorage, step: int, relpath: str, start: int, length: int) -> bytes:
    """`length` bytes at `start` of a file of `step` (a ranged GET on S3)."""
    remote = entry_path(storage, step, relpath)
    with storage.io(f"reading {relpath} of step {step}", passthrough=(FileNotFoundError,)):
        try:
            return storage.retrying(
                lambda: storage.fs.cat_file(remote, start=start, end=start + length)
            )
        except FileNotFoundError as e:
            raise CorruptCheckpointError(
                step, relpath, "missing from storage", uri=storage.uri
            ) from e


def verify_remote(storage: StepStorage, manifest: Manifest) -> None:
    """Hash every file of ``manifest`` in storage (streamed); raise CorruptCheckpointError."""
    step = manifest.step
    for entry in manifest.files:
        remote = entry_path(storage, step, entry.path)
        h = hashlib.sha256()
        size = 0
        with storage.io(f"verifying {entry.path} of step {step}", passthrough=(FileNotFoundError,)):
            try:
                with storage.fs.open(remote, "rb", block_size=HASH_CHUNK_BYTES) as f:
                    while chunk := f.read(HASH_CHUNK_BYTES):
                        h.update(chunk)
                        size += len(chunk)
            except FileNotFoundError as e:
                raise CorruptCheckpointError(
                    step, entry.path, "missing from storage", uri=storage.uri
                ) from e
        reason = describe_mismatch(size, h.hexdigest(), entry)
        if reason:
            raise CorruptCheckpointError(step, entry.path, reason, uri=storage.uri)


def describe_mismatch(size: int, digest: str | None, entry: FileEntry) -> str | None:
    """Why a file of `size` bytes and sha256 `digest` is not `entry`, or None."""
    if size != entry.size:
        return f"size is {size} bytes, manifest says {entry.size}"
    if digest is not None and digest != entry.sha256:
        return f"sha256 is {digest[:16]}..., manifest says {entry.sha256[:16]}..."
    return None
