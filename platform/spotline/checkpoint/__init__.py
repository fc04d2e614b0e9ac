"""Checkpoints: a step's files uploaded to storage, committed by a manifest written last,
restored from the newest step that verifies (file:// or s3://).

The room is layered; arrows point down:

- `coordinator` (with `retention`): the only owner of receipts -> manifest -> retention ->
  quarantine -> restore fallback. The controller talks to storage only through it.
- `store.CheckpointStore`: the facade other rooms use, over `uploads` (files, the rate
  pacer, receipts), `reads` (ranged reads, verification), `catalog` (listings, the
  manifest commit, quarantine records) and `probes` (preflight checks). Under them
  all lies the checkpoint root as storage (`spotline.storage.checkpoint_root`, with
  its `backends` and `s3`), retried through `spotline.storage.retry`.
- `reshard`: the index readers, the planner that maps a saved step onto any new shape,
  and the verified (sha256) ranged reads; used by train/, backfill and export.
- `layout`: what a step's files are (safetensors entries, chunk hashes, meta files),
  written by a rank and hashed once as written.
- `manifest`, `errors`, `staging`: pure data, messages and paths; `transfer`: a rank's
  background uploader (which also hands each save's files to peer memory).
- `peer`: a rank's peer copy (its checkpoint files, kept in live nodes' memory by the
  runtime's state keepers) and the newest step one group left complete there, as a
  manifest the same restore path loads.

Never: hand back a checkpoint that has not been verified, unpickle anything read from
storage, delete an upload that may still be running, let a path from a manifest leave
its step, or put a secret in a message. Imports nothing heavy: the S3 client packages
load only when an s3:// URI is used.
"""

from spotline.checkpoint.errors import CheckpointMismatchError, CorruptCheckpointError
from spotline.checkpoint.manifest import FileEntry, Manifest, ManifestError
from spotline.checkpoint.store import (
    LEDGER_ARTIFACT,
    SUMMARY_ARTIFACT,
    TOKENIZER_ARTIFACTS,
    TRACE_ARTIFACT,
    CheckpointStore,
)
from spotline.storage.errors import StorageError, StoreFields
from spotline.storage.fs import hash_file

__all__ = [
    "LEDGER_ARTIFACT",
    "SUMMARY_ARTIFACT",
    "TOKENIZER_ARTIFACTS",
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
