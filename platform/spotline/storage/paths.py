"""Entry paths from an index, a manifest or a receipt, checked and joined under a root.

An entry path is a relative posix path such as ``shard-00003.npy`` or
``a-1f2e/rank_00001/state.safetensors``. Anything else (absolute, ``..``, a URI or a
drive, a backslash, a NUL, an empty or ``.`` segment) is refused, whatever the
filesystem: a check that depended on how one backend normalizes paths would let the
same entry through on another.
"""

from __future__ import annotations

import os

__all__ = ["UnsafePathError", "check_relpath", "join_under"]


class UnsafePathError(ValueError):
    """An entry path that is not a plain relative path under its root.

    `path` is the entry as it was read; `why` says what is wrong with it in a few words
    ("holds '..'"), for the caller to put in a message that names the entry and the fix.
    """

    def __init__(self, path: object, why: str):
        self.path = path
        self.why = why
        super().__init__(f"{path!r} {why}")


def check_relpath(path: object) -> str:
    """`path` itself when it is a relative posix path that stays under any root it is
    joined to; UnsafePathError saying why not."""
    if not isinstance(path, str) or not path:
        raise UnsafePathError(path, "is not a non-empty string")
    if "\x00" in path:
        raise UnsafePathError(path, "holds a NUL byte")
    if "\\" in path:
        raise UnsafePathError(path, "holds a backslash")
    if path.startswith("/"):
        raise UnsafePathError(path, "is absolute")
    first = path.split("/", 1)[0]
    if ":" in first:
        # s3://other/x, file:/etc, C:x: a location of its own, not a place under the root.
        raise UnsafePathError(path, f"names a scheme or drive ({first.split(':', 1)[0]}:)")
    parts = path.split("/")
    if ".." in parts:
        raise UnsafePathError(path, "holds '..'")
    if any(p in ("", ".") for p in parts):
        raise UnsafePathError(path, "holds an empty or '.' segment")
    return path


def join_under(root: str | os.PathLike[str], path: object, *, local: bool = False) -> str:
    """`root`/`path` once `path` is checked (`check_relpath`).

    `root` is a directory in any filesystem: a local path, or an fsspec path such as
    ``bucket/prefix``. With `local`, symlinks are resolved too, and the real path is
    returned only when it lies under the real path of `root`: a link planted in a
    dataset folder must not make a reader open a file elsewhere. The real path is what
    the caller opens: the file that was checked, not whatever the name points at later.
    """
    rel = check_relpath(path)
    joined = os.fspath(root).rstrip("/") + "/" + rel
    if not local:
        return joined
    real_root = os.path.realpath(root)
    real = os.path.realpath(joined)
    if os.path.commonpath([real_root, real]) != real_root:
        raise UnsafePathError(path, f"resolves through a symlink to {real}, outside {real_root}")
    return real
