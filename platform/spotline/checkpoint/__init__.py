"""Checkpoint storage: step files plus a manifest commit, on file:// or s3://.

Imports nothing heavy: the S3 client packages load only when an s3:// URI is used.
"""

from spotline.checkpoint.manifest import FileEntry, Manifest, ManifestError
from spotline.checkpoint.store import (
    LEDGER_ARTIFACT,
    SUMMARY_ARTIFACT,
    TRACE_ARTIFACT,
    CheckpointMismatchError,
    CheckpointStore,
    CorruptCheckpointError,
    StorageError,
    StoreFields,
    hash_file,
)

__all__ = [
    "LEDGER_ARTIFACT",
    "SUMMARY_ARTIFACT",
    "TRACE_ARTIFACT",
    "CheckpointMismatchError",
    "CheckpointStore",
    "CorruptCheckpointError",
    "FileEntry",
    "Manifest",
    "ManifestError",
    "StorageError",
    "StoreFields",
    "hash_file",
]
