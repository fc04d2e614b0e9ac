"""Storage: the rules every reader of a dataset's or a checkpoint's files follows.

Indexes, manifests and receipts are read back from storage that other programs can
write to, so every path they hold is an untrusted string. `join_under` is the one
place such a path becomes a file to open: it is refused unless it stays under its
root, on a local disk (symlinks resolved) and in object storage alike.

Destinations the user names (`--out`) are looked at before anything is written there:
`files_under` lists what a destination already holds, so a writer can refuse to replace
it without `--overwrite`.

`fs` is the one fsspec layer both of them read and write through: what a URI is,
the options its filesystem takes (checked), what a read error means in one line, and
the sha256 of a local file.

This room sits below data/ and checkpoint/: it must never import from the rest of
Spotline (no config, no runtime, no Ray). It never writes or removes a file, and reads
only to list a destination or hash a local file; its callers do the rest, with the
paths and options it hands back.
"""

from spotline.storage.outputs import files_under, some_names
from spotline.storage.paths import UnsafePathError, check_relpath, join_under

__all__ = ["UnsafePathError", "check_relpath", "files_under", "join_under", "some_names"]
