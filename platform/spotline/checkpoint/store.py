"""The checkpoint store: one root URI of checkpoint steps, as the rest of Spotline uses it.

`CheckpointStore` is a facade over the layers of this room, on top of the checkpoint
root's storage (`spotline.storage.checkpoint_root`: the root, its backend and
filesystem, retries): `uploads` (files, the rate pacer, receipts), `reads`
(ranged reads, verification), `catalog` (listings, the manifest commit, quarantine) and
`probes` (preflight). Its methods only pass on to them. Beside them it writes and reads
the job's artifacts, and checks that a root holds this job's checkpoints
(`check_owner`).

Retention is not here: the commit coordinator applies checkpoint.keep_last
(`retention.py`). This module must never hand back a checkpoint it has not verified;
the layers it passes to keep the commit protocol's other promises.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from spotline.checkpoint import catalog, probes, reads, uploads
from spotline.checkpoint.errors import CheckpointMismatchError, CorruptCheckpointError
from spotline.checkpoint.layout import FileDigest
from spotline.checkpoint.manifest import FileEntry, Manifest, Receipt, check_relpath
from spotline.checkpoint.uploads import ReceiptScan
from spotline.config.identity import foreign_job, mismatch_reason
from spotline.storage.checkpoint_root import (
    ARTIFACTS_DIR,
    MANIFEST_NAME,
    QUARANTINE_NAME,
    RECEIPTS_DIR,
    StepStorage,
)
from spotline.storage.errors import SPEC_FIELDS, StorageError, StoreFields
from spotline.storage.fs import hash_file

__all__ = [
    "ARTIFACTS_DIR",
    "LEDGER_ARTIFACT",
    "MANIFEST_NAME",
    "QUARANTINE_NAME",
    "RECEIPTS_DIR",
    "SPEC_FIELDS",
    "SUMMARY_ARTIFACT",
    "TRACE_ARTIFACT",
    "CheckpointMismatchError",
    "CheckpointStore",
    "CorruptCheckpointError",
    "ReceiptScan",
    "StorageError",
    "StoreFields",
    "hash_file",
]

# The job's artifacts beside its checkpoints (see write_artifact).
TRACE_ARTIFACT = "trace.json"  # Chrome trace of the latest pipeline steps
SUMMARY_ARTIFACT = "summary.json"  # what `spotline status` / `report` show
LEDGER_ARTIFACT = "ledger.json"  # the goodput ledger, continued by a restarted controller
TOKENIZER_ARTIFACTS = "tokenizer"  # copies of the tokenizer's files, for `spotline export`


class CheckpointStore(StepStorage):
    """Checkpoint steps under one root URI: upload, commit, list, restore.

    Safe to pickle (Ray ships it to workers); the filesystem client is rebuilt on
    first use in each process. Safe to call from several threads. The constructor's
    arguments are those of `StepStorage`.
    """

    def sibling(self, uri: str) -> CheckpointStore:
        """A store at another root URI with this one's endpoint, storage options and
        signing key (a checkpoint.resume_from source)."""
        b = self.backend
        return CheckpointStore(
            uri,
            b.endpoint_url,
            b.options,
            multipart_chunksize=self._multipart_chunksize,
            signing_key_env=self.signing_key_env,
            fields=self.fields._replace(uri="checkpoint.resume_from.uri"),
        )

    def __repr__(self) -> str:
        return f"CheckpointStore({self.uri!r})"

    def artifact_path(self, relpath: str) -> str:
        """Where an artifact lies (`relpath` checked: it never leaves the artifacts)."""
        return f"{self.backend.root}/{ARTIFACTS_DIR}/{check_relpath(relpath)}"

    # --- writing ----------------------------------------------------------------------

    def upload_file(self, local_path: str | os.PathLike[str], step: int, relpath: str) -> FileEntry:
        """Upload one local file to ``<root>/step_xxx/<relpath>``; its manifest entry
        (sha256 of the local file). See `uploads.upload_file`."""
        return uploads.upload_file(self, local_path, step, relpath)

    def upload_dir(
        self,
        local_dir: str | os.PathLike[str],
        step: int,
        prefix: str = "",
        max_bytes_per_s: float | None = None,
        known: Mapping[str, FileDigest] | None = None,
    ) -> list[FileEntry]:
        """Upload every file under ``local_dir`` (as ``prefix`` + its relative path), in
        parallel or paced to ``max_bytes_per_s``; entries sorted by path. `known`: the
        sizes and sha256s the writer computed (`layout.RankFiles.files`), not hashed
        again."""
        return uploads.upload_dir(self, local_dir, step, prefix, max_bytes_per_s, known)

    def commit(self, manifest: Manifest, check: bool = True) -> None:
        """Make a step visible to readers by writing its manifest, after checking its
        files are in storage (CorruptCheckpointError otherwise); without `check`, the
        caller checks them later (`bad_files`)."""
        catalog.commit(self, manifest, check)

    def bad_files(self, manifest: Manifest) -> list[tuple[str, str]]:
        """(path, what is wrong) for each file of `manifest` storage lacks or holds at
        another size (see `catalog.bad_files`)."""
        return catalog.bad_files(self, manifest)

    def mark_checked(self, step: int) -> None:
        """Record that the files of the step's manifest were listed present (see
        `catalog.mark_checked`): later readers need not list them again."""
        catalog.mark_checked(self, step)

    def write_receipt(self, receipt: Receipt) -> bytes:
        """Record that a rank finished uploading its files of a step (signed when
        checkpoint.signing_key_env is set); the bytes written."""
        return uploads.write_receipt(self, receipt)

    def write_node_receipts(
        self, step: int, attempt: str, leader: int, bodies: list[bytes]
    ) -> None:
        """Write a node's receipts of a step, each as its rank wrote it, as one object."""
        uploads.write_node_receipts(self, step, attempt, leader, bodies)

    def write_artifact(self, relpath: str, data: bytes) -> str:
        """Write a job artifact (trace, backfill output, ledger) beside the steps; its URI.

        Artifacts live under ``<root>/artifacts/``, outside every step directory, so
        retention never deletes them and a restore never downloads them.
        """
        path = self.artifact_path(relpath)
        with self.io(f"writing artifact {relpath}"):
            self.write_atomic(path, data)
        return self.full_uri(path)

    def remove(self, step: int, relprefix: str) -> None:
        """Delete everything under `relprefix` of a step (an abandoned attempt's files)."""
        catalog.remove(self, step, relprefix)

    def quarantine(self, step: int, path: str, reason: str) -> str:
        """Set aside a committed step that failed verification; the URI of its record
        (see `catalog.quarantine`)."""
        return catalog.quarantine(self, step, path, reason)

    # --- reading ----------------------------------------------------------------------

    def read_artifact(self, relpath: str) -> bytes | None:
        """An artifact written by `write_artifact`, or None if there is none."""
        path = self.artifact_path(relpath)
        with self.io(f"reading artifact {relpath}", passthrough=(FileNotFoundError,)):
            try:
                return self.fs.cat_file(path)
            except FileNotFoundError:
                return None

    def read_receipts(self, step: int) -> ReceiptScan:
        """Upload receipts of a step by the group that wrote them; those that cannot
        complete a commit are listed as refused."""
        return uploads.read_receipts(self, step)

    def receipt_attempts(self, step: int) -> set[str]:
        """The groups (attempts) with upload receipts under a step; none is read."""
        return uploads.receipt_attempts(self, step)

    def read_range(self, step: int, relpath: str, start: int, length: int) -> bytes:
        """`length` bytes at `start` of a file of `step` (a ranged GET on S3)."""
        return reads.read_range(self, step, relpath, start, length)

    def verify_remote(self, manifest: Manifest) -> None:
        """Hash every file of ``manifest`` in storage (streamed); raise CorruptCheckpointError."""
        reads.verify_remote(self, manifest)

    def list_steps(self) -> catalog.Steps:
        """Every step under the root by state: committed (its manifest verifies), damaged,
        quarantined, uncommitted. See `catalog.list_steps`."""
        return catalog.list_steps(self)

    def committed_steps(self) -> list[int]:
        """Steps whose manifest verifies, ascending. Step directories without one, and
        those whose manifest does not, are ignored."""
        return catalog.committed_steps(self)

    def uncommitted_steps(self) -> list[int]:
        """Step directories with neither a manifest nor a quarantine record, ascending
        (uploads in flight or abandoned)."""
        return catalog.uncommitted_steps(self)

    def quarantined_steps(self) -> list[int]:
        """Steps set aside after they failed verification (see `quarantine`), ascending."""
        return catalog.quarantined_steps(self)

    def holds_quarantine_record(self, step: int) -> bool:
        """The step's folder holds a quarantine record (it is quarantined, or was)."""
        return catalog.holds_quarantine_record(self, step)

    def load_manifest(self, step: int) -> Manifest:
        """Read the manifest of a committed step: FileNotFoundError if it is not
        committed, CorruptCheckpointError if it cannot be parsed or verified."""
        return catalog.load_manifest(self, step)

    def latest_manifest(self) -> Manifest | None:
        """Manifest of the newest committed step, or None if nothing is committed."""
        return catalog.latest_manifest(self)

    # --- ownership --------------------------------------------------------------------

    def of_job(self, spec: Any, records_checks: bool = False) -> CheckpointStore:
        """From now on, only `spec`'s steps count as committed here: a manifest of another
        job, or of a spec this one may not resume, is damaged (`catalog.list_steps`).
        `records_checks`: a listing that finds a manifest's files present records it
        (the commit coordinator's store). This store, for chaining."""
        self.owner = spec
        self.records_checks = records_checks
        return self

    def check_owner(self, spec: Any) -> None:
        """Raise CheckpointMismatchError when this URI holds only another job's
        checkpoints, or only this job's written with a spec this one may not resume
        (beyond RETUNABLE_FIELDS). Reads only; writes nothing.

        One committed step of this job's is enough: another job's manifests beside it
        are set aside by the commit coordinator, and never keep the job from its own
        commits. With none committed, the stored job summary decides (a job that failed
        before its first commit still owns its URI).
        """
        owner, self.owner = self.owner, spec
        try:
            steps = catalog.list_steps(self)
        finally:
            self.owner = owner
        if steps.committed:
            return
        if steps.foreign:
            newest = max(steps.foreign)
            why = steps.foreign[newest].removeprefix(catalog.FOREIGN)
            others = sorted(steps.foreign)
            more = (
                f" ({len(others)} such steps: {', '.join(map(str, others[:8]))}"
                f"{', ...' if len(others) > 8 else ''})"
                if len(others) > 1
                else ""
            )
            raise CheckpointMismatchError(
                f"{self.fields.uri} {self.uri}: checkpoint step {newest} there {why}{more}, "
                "and none there is this job's. Nothing was written there, and nothing is "
                f"deleted. Point {self.fields.uri} at a new location (e.g. --set "
                "checkpoint.uri=...) to run this job, or use the original job name and spec "
                "to resume those steps"
            )
        raw = self.read_artifact(SUMMARY_ARTIFACT)
        try:
            summary = json.loads(raw) if raw else {}
        except ValueError:
            summary = {}
        job = summary.get("name") if isinstance(summary, dict) else None
        if foreign_job(spec, job):
            raise CheckpointMismatchError(self.describe_mismatch(spec, job, None, None, None))

    def describe_mismatch(
        self, spec: Any, job: str | None, their_hash: str | None, theirs: Any, step: int | None
    ) -> str:
        what = f"checkpoint step {step}" if step is not None else "the job summary"
        why = mismatch_reason(spec, job, their_hash, theirs)
        return (
            f"{self.fields.uri} {self.uri}: {what} there {why}. Nothing was written there. "
            f"Point {self.fields.uri} at a new location (e.g. --set checkpoint.uri=...), or use the "
            "original job name and spec to resume it"
        )

    # --- preflight --------------------------------------------------------------------

    def check_credentials(self) -> None:
        """S3: fail now (StorageError) if no credentials can be found. No-op for local paths."""
        probes.check_credentials(self)

    def check_writable(self, timeout_s: float | None = None) -> None:
        """Preflight: write, read back and delete a small probe object under the root;
        any failure is a StorageError that says what happened and how to fix it."""
        probes.check_writable(self, timeout_s)
