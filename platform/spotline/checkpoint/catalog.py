"""The catalog of checkpoint steps under a root: which steps exist and in what state
(committed, damaged, uploading or abandoned, quarantined), the manifest commit, manifest
reads, quarantine records and deletions.

A step is committed only when its ``manifest.json`` parses, names its own step and, when
checkpoint.signing_key_env is set, its signature verifies; when the store knows its job
(`CheckpointStore.of_job`), the manifest is that job's, written under a spec it may
resume; and the files it names are known present: listed in storage, recorded as listed
by a ``checked.json`` beside it, or (for a manifest this storage object wrote) vouched for
by the ranks that uploaded them, until the commit coordinator lists them. That is the
one meaning of "committed" for retention, abandonment, commit-from-storage, restore and
every reader. A manifest that does not (planted, truncated, signed with another key,
another job's, a copy renumbered into another folder without its files) makes its step
damaged: neither committed nor an upload, so nothing counts it and nothing deletes it
until the commit coordinator quarantines it. Each manifest is judged once, and one this
storage object wrote not at all; later listings only look at its size and version
(`StepStorage.verdicts`), and the newest verified one is kept parsed
(`StepStorage.newest_manifest`).

A step directory without ``manifest.json`` is an upload in progress, an abandoned one or
a quarantined one; it is never offered for restore. The manifest is written last (once
its files are in storage: checked first, or reported uploaded by every rank and checked
by the coordinator before retention deletes anything) and deleted first, so no reader
sees a manifest whose files retention removed.

Which steps go, and when, is not decided here: that is the commit coordinator's
retention (`retention.py`). This module never deletes a step unless asked to.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import posixpath
import re
import time
from dataclasses import dataclass, field
from typing import Any

from spotline.checkpoint.errors import CorruptCheckpointError
from spotline.checkpoint.manifest import (
    Manifest,
    ManifestError,
    check_relpath,
    dump_signed,
    load_signed,
)
from spotline.config.identity import mismatch_reason, resumable_by
from spotline.config.redact import redact
from spotline.storage.checkpoint_root import CHECKED_NAME, MANIFEST_NAME, StepStorage

_STEP_RE = re.compile(r"^step_(\d{8,})$")


# --- listings -------------------------------------------------------------------------


def step_dirs(storage: StepStorage) -> list[int]:
    """Every step with a directory under the root, ascending."""
    with storage.io("listing checkpoint steps"):
        try:
            names = storage.fs.ls(storage.backend.root, detail=False)
        except FileNotFoundError:
            return []
    steps = []
    for name in names:
        m = _STEP_RE.match(posixpath.basename(str(name).rstrip("/")))
        if m:
            steps.append(int(m.group(1)))
    return sorted(set(steps))


@dataclass(frozen=True)
class Steps:
    """Every step directory under a root, by state, from one listing; each ascending."""

    committed: list[int] = field(default_factory=list)
    """Steps whose manifest parses, names the step, verifies (with a signing key), is
    this job's (when the store knows its job) and whose files are known present."""
    damaged: dict[int, str] = field(default_factory=dict)
    """Steps whose manifest does not: step -> what is wrong with it."""
    foreign: dict[int, str] = field(default_factory=dict)
    """The damaged steps whose manifest is whole but another job's or spec's: step ->
    whose it is. A subset of `damaged`."""
    quarantined: list[int] = field(default_factory=list)
    """Steps set aside after they failed verification (see `quarantine`)."""
    uncommitted: list[int] = field(default_factory=list)
    """Steps with neither a manifest nor a quarantine record: uploads in flight or
    abandoned."""


def list_steps(storage: StepStorage) -> Steps:
    """Every step under the root by state. A manifest is judged when it is new or
    changed (by size and version) since this storage object last judged it: read and
    verified, its job and spec compared with the store's (`storage.owner`), and its
    files found present, from its `checked.json` or else from a listing of its files.
    Other steps cost one metadata request, and a step without a manifest a second one
    (its quarantine record)."""
    key = storage.signing_key()  # a key missing here is the job's error, not a damaged step
    key_id = _key_id(key, storage.owner)
    out = Steps()
    verdicts: dict[int, tuple[Any, str | None]] = {}
    for step in step_dirs(storage):
        stamp = _manifest_stamp(storage, step, key_id)
        if stamp is not None:
            verdict = storage.verdicts.get(step)
            if verdict is None or verdict[0] != stamp:
                try:
                    why, manifest = _judge(storage, step, key)
                    verdict = (stamp, why)
                except FileNotFoundError:  # deleted since it was listed
                    stamp = None
                else:
                    newest = storage.newest_manifest
                    if manifest is not None and (newest is None or step >= newest[1].step):
                        storage.newest_manifest = (stamp, manifest)
            if stamp is not None:
                verdicts[step] = verdict
                if verdict[1] is None:
                    out.committed.append(step)
                else:
                    out.damaged[step] = verdict[1]
                    if verdict[1].startswith(FOREIGN):
                        out.foreign[step] = verdict[1]
                continue
        if holds_quarantine_record(storage, step):
            out.quarantined.append(step)
        else:
            out.uncommitted.append(step)
    storage.verdicts = verdicts  # the steps that are gone are forgotten
    return out


FOREIGN = "it is not this job's: it "
"""How the reason of a well-formed manifest of another job or spec starts."""


def _manifest_stamp(storage: StepStorage, step: int, key_id: str | None) -> tuple | None:
    """What identifies the step's manifest as it is now (size, ETag or mtime, inode, and
    the key and job it is judged with); None when the step has no manifest."""
    with storage.io(f"checking the manifest of step {step}"):
        try:
            info = storage.fs.info(storage.manifest_path(step))
        except FileNotFoundError:
            return None
    version = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified")
    return (info.get("size"), str(version), info.get("ino"), key_id)


def _key_id(key: bytes | None, owner: Any = None) -> str | None:
    """What names the signing key and the judging job in a manifest's stamp, without
    the key."""
    who = f"{owner.name}/{owner.spec_hash()}" if owner is not None else ""
    if key is None:
        return who or None
    return hashlib.sha256(b"spotline manifest key " + key).hexdigest() + who


def _judge(
    storage: StepStorage, step: int, key: bytes | None
) -> tuple[str | None, Manifest | None]:
    """(what is wrong with the step, None), or (None, the manifest) when it counts as
    committed: it parses, verifies and names its step; it is the store's job's; and its
    files are known present. FileNotFoundError when the manifest is gone."""
    raw = _read_manifest(storage, step)
    try:
        manifest = _parse(storage, step, raw, key)
    except CorruptCheckpointError as e:
        return e.reason, None
    storage.manifest_sha[step] = hashlib.sha256(raw).hexdigest()
    owner = storage.owner
    if owner is not None:
        job = manifest.extra.get("job")
        if not resumable_by(owner, job, manifest.spec_hash, manifest.extra.get("spec")):
            why = mismatch_reason(owner, job, manifest.spec_hash, manifest.extra.get("spec"))
            return FOREIGN + why, None
    if _checked(storage, step, key):
        return None, manifest
    bad = bad_files(storage, manifest)
    if bad:
        path, reason = bad[0]
        more = (
            f" (and {len(bad) - 1} more of its {len(manifest.files)} files)" if len(bad) > 1 else ""
        )
        return (
            f"it names {path}, which {reason}{more}: a manifest copied or left without its files",
            None,
        )
    if storage.records_checks:
        mark_checked(storage, step)
    return None, manifest


def _checked(storage: StepStorage, step: int, key: bytes | None) -> bool:
    """Whether the step's `checked.json` vouches for the manifest read now: it names
    this step and this manifest's sha256 (and verifies, with a signing key)."""
    with storage.io(f"reading the file check of step {step}"):
        try:
            raw = storage.fs.cat_file(storage.checked_path(step))
        except FileNotFoundError:
            return False
    try:
        record = load_signed(raw, key, f"{CHECKED_NAME} of step {step}", "written")
    except ManifestError:
        return False  # unreadable or unsigned: the files are listed instead
    return record.get("step") == step and record.get("manifest_sha256") == storage.manifest_sha.get(
        step
    )


def mark_checked(storage: StepStorage, step: int) -> None:
    """Record that the files of the step's manifest (as this object last wrote or read
    it) were listed present, so that later readers need not list them again."""
    sha = storage.manifest_sha.get(step)
    if sha is None:
        return
    record = {"step": step, "manifest_sha256": sha, "checked_at": time.time()}
    data = dump_signed(record, storage.signing_key()).encode()
    with storage.io(f"writing the file check of step {step}"):
        storage.write_atomic(storage.checked_path(step), data)


def holds_quarantine_record(storage: StepStorage, step: int) -> bool:
    """The step's folder holds a quarantine record: it is quarantined, or was, and a
    later save of the same step committed beside the files kept for inspection."""
    with storage.io(f"checking the quarantine record of step {step}"):
        return bool(storage.fs.exists(storage.quarantine_path(step)))


def committed_steps(storage: StepStorage) -> list[int]:
    """Steps whose manifest verifies, ascending (see `list_steps`)."""
    return list_steps(storage).committed


def uncommitted_steps(storage: StepStorage) -> list[int]:
    """Step directories with neither a manifest nor a quarantine record, ascending
    (uploads in flight or abandoned)."""
    return list_steps(storage).uncommitted


def quarantined_steps(storage: StepStorage) -> list[int]:
    """Steps set aside after they failed verification (see `quarantine`), ascending."""
    return list_steps(storage).quarantined


# --- manifests ------------------------------------------------------------------------


def commit(storage: StepStorage, manifest: Manifest, check: bool = True) -> None:
    """Make a step visible to readers by writing its manifest.

    With `check`, first refuses (CorruptCheckpointError) if a listed file is absent or
    has another size in storage: committing it would publish a checkpoint that cannot
    load; then records the check (`checked.json`). Without it, the caller holds every
    writer's word that its upload succeeded and checks the files itself before anything
    older is deleted (`bad_files`, then `mark_checked`).
    """
    step = manifest.step
    if check and (bad := bad_files(storage, manifest)):
        path, reason = bad[0]
        raise CorruptCheckpointError(
            step,
            path,
            reason,
            uri=storage.uri,
            message=f"refusing to commit checkpoint step {step} at {storage.uri}: "
            f"{path} {reason}; upload it before committing",
        )
    key = storage.signing_key()
    data = manifest.to_json(key).encode()
    with storage.io(f"writing the manifest of step {step}"):
        storage.write_atomic(storage.manifest_path(step), data)
    storage.manifest_sha[step] = hashlib.sha256(data).hexdigest()
    if check:
        mark_checked(storage, step)
    # Known as written: the next listing and load need not read megabytes back to parse.
    # Without `check` its files are vouched for by their writers until the caller lists
    # them; any other reader (a restarted controller) lists them itself.
    stamp = _manifest_stamp(storage, step, _key_id(key, storage.owner))
    if stamp is not None:
        storage.verdicts[step] = (stamp, None)
        newest = storage.newest_manifest
        if newest is None or step >= newest[1].step:
            storage.newest_manifest = (stamp, manifest)


def bad_files(storage: StepStorage, manifest: Manifest) -> list[tuple[str, str]]:
    """(path, what is wrong) for each file `manifest` names that storage lacks or holds
    at another size, from one listing of the folders its files are in."""
    step = manifest.step
    step_path = storage.step_path(step)
    # Only the folders its files are in (a group's folder): the step's receipts, one a
    # rank, are a third of its keys, and S3 lists 1,000 keys a request, one after another.
    tops = {e.path.split("/", 1)[0] if "/" in e.path else "" for e in manifest.files}
    found: dict[str, Any] = {}
    for top in [""] if "" in tops else sorted(tops):
        folder = f"{step_path}/{top}" if top else step_path
        with (
            storage.io(f"listing the files of step {step}"),
            contextlib.suppress(FileNotFoundError),
        ):
            found.update(storage.fs.find(folder, detail=True))
    sizes = {_relpath(k, step_path): v.get("size") for k, v in found.items()}
    bad = []
    for entry in manifest.files:
        have = sizes.get(entry.path)
        if have is None:
            bad.append((entry.path, "is not in storage"))
        elif have != entry.size:
            bad.append((entry.path, f"is {have} bytes in storage, manifest says {entry.size}"))
    return bad


def _relpath(path: str, root: str) -> str:
    """`path` relative to `root`: a slice where it is under `root` as written (every
    listed key, thousands a commit), else posixpath's."""
    head = root.rstrip("/") + "/"
    return path[len(head) :] if path.startswith(head) else posixpath.relpath(path, root)


def load_manifest(storage: StepStorage, step: int) -> Manifest:
    """Read the manifest of a committed step.

    Raises FileNotFoundError if the step is not committed, CorruptCheckpointError
    if its manifest cannot be parsed or verified. The newest manifest a listing verified
    is not read again while its stamp is unchanged (a restore lists, then loads it: at
    thousands of ranks each parse of megabytes of JSON is a few tenths of a second).
    """
    key = storage.signing_key()
    kept = storage.newest_manifest
    if (
        kept is not None
        and kept[1].step == step
        and _manifest_stamp(storage, step, _key_id(key, storage.owner)) == kept[0]
    ):
        return kept[1]
    return _parse(storage, step, _read_manifest(storage, step), key)


def _read_manifest(storage: StepStorage, step: int) -> bytes:
    path = storage.manifest_path(step)
    with storage.io(f"reading the manifest of step {step}", passthrough=(FileNotFoundError,)):
        try:
            return storage.fs.cat_file(path)
        except FileNotFoundError as e:
            raise FileNotFoundError(
                f"checkpoint step {step} is not committed at {storage.uri} (no {MANIFEST_NAME})"
            ) from e


def _parse(storage: StepStorage, step: int, raw: bytes, key: bytes | None) -> Manifest:
    """The manifest of `step` from its bytes: CorruptCheckpointError when it does not
    parse, does not verify with `key`, or names another step."""
    try:
        manifest = Manifest.from_json(raw, key)
    except ManifestError as e:
        raise CorruptCheckpointError(step, MANIFEST_NAME, str(e), uri=storage.uri) from e
    if manifest.step != step:
        raise CorruptCheckpointError(
            step,
            MANIFEST_NAME,
            f"it says step {manifest.step} but lies in {storage.step_name(step)}",
            uri=storage.uri,
        )
    return manifest


def latest_manifest(storage: StepStorage) -> Manifest | None:
    """Manifest of the newest committed step, or None if nothing is committed."""
    steps = committed_steps(storage)
    return load_manifest(storage, steps[-1]) if steps else None


# --- quarantine and deletion ----------------------------------------------------------


def quarantine(storage: StepStorage, step: int, path: str, reason: str) -> str:
    """Set aside a step that failed verification (its files, or its manifest itself);
    the URI of its record.

    The record (which file failed, why, and the manifest as it was) is written
    first, then the manifest goes: from then on no listing offers the step, no
    restore reads it again and retention neither counts nor deletes it, and its
    files stay where they are for inspection. A marker rather than a move: on S3 a
    move is a copy of every file, and a crash halfway would tear the evidence. A
    crash between the two writes leaves the manifest where it was, so the next
    commit or restore verifies it again and finishes the job.
    """
    record_path = storage.quarantine_path(step)
    with storage.io(f"quarantining step {step}"):
        try:
            raw = storage.fs.cat_file(storage.manifest_path(step))
        except FileNotFoundError:
            raw = None
        record = {
            "step": step,
            "file": path,
            "reason": redact(reason),
            "quarantined_at": time.time(),
            "manifest": raw.decode("utf-8", "replace") if raw is not None else None,
        }
        storage.write_atomic(record_path, json.dumps(record, indent=1).encode())
        with contextlib.suppress(FileNotFoundError):
            storage.fs.rm_file(storage.manifest_path(step))
    return storage.full_uri(record_path)


def remove(storage: StepStorage, step: int, relprefix: str) -> None:
    """Delete everything under `relprefix` of a step (an abandoned attempt's files)."""
    path = f"{storage.step_path(step)}/{check_relpath(relprefix)}"
    with (
        storage.io(f"deleting {relprefix} of step {step}"),
        contextlib.suppress(FileNotFoundError),
    ):
        storage.fs.rm(path, recursive=True)


def delete_committed(storage: StepStorage, step: int) -> None:
    """Delete a committed step: its manifest first (no reader is then offered it), then
    its files."""
    with (
        storage.io(f"deleting the manifest of expired step {step}"),
        contextlib.suppress(FileNotFoundError),
    ):
        storage.fs.rm_file(storage.manifest_path(step))
    delete_step_dir(storage, step)


def delete_step_dir(storage: StepStorage, step: int) -> None:
    """Delete a step's whole directory (an expired or abandoned step)."""
    with storage.io(f"deleting step {step}"), contextlib.suppress(FileNotFoundError):
        storage.fs.rm(storage.step_path(step), recursive=True)
