"""Storage: the rules every reader of a dataset's or a checkpoint's files follows.

Indexes, manifests and receipts are read back from storage that other programs can
write to, so every path they hold is an untrusted string. `join_under` is the one
place such a path becomes a file to open: it is refused unless it stays under its
root, on a local disk (symlinks resolved) and in object storage alike.

This room sits below data/ and checkpoint/: it must never import from the rest of
Spotline (no config, no runtime, no Ray), and it never opens, lists or writes a file
itself; its callers do, with the path it hands back.
"""

from spotline.storage.paths import UnsafePathError, check_relpath, join_under

__all__ = ["UnsafePathError", "check_relpath", "join_under"]
