"""Storage: the one fsspec/boto3 layer, for datasets, tokenizers, models and checkpoints.

- `paths`: the rules every reader of a dataset's or a checkpoint's files follows.
  Indexes, manifests and receipts are read back from storage that other programs can
  write to, so every path they hold is an untrusted string: `join_under` is the one
  place such a path becomes a file to open, refused unless it stays under its root,
  on a local disk (symlinks resolved) and in object storage alike.
- `outputs`: destinations the user names (`--out`) are looked at before anything is
  written there (`files_under`), so a writer can refuse to replace one without
  `--overwrite`.
- `fs`: what a URI is, the options its filesystem takes (checked), what a read error
  means in one line, and the sha256 of a local file.
- `retry`: the one retry policy (tenacity): what is transient, how a call is tried
  again, and how a reading is polled until it settles. Every retry in Spotline goes
  through it.
- `checkpoint_root` with `backends` (file://) and `s3` (s3fs for listings and small
  writes, boto3's managed transfer for step files): a checkpoint root as storage, and
  `errors`, a storage failure in words (`StorageError`).

This room is the foundation under data/ and checkpoint/: of the rest of Spotline it
imports only the constants and config's one redaction function, never another room,
the runtime or Ray. It
never decides which checkpoint step is committed, good or due for deletion, never
unpickles what it reads, and never lets a secret into a message. Optional S3 packages
are imported only when an s3:// URI is used.
"""

from spotline.storage.outputs import files_under, some_names
from spotline.storage.paths import UnsafePathError, check_relpath, join_under

__all__ = ["UnsafePathError", "check_relpath", "files_under", "join_under", "some_names"]
