"""The checkpoint manifest: the one file whose presence makes a step committed.

A manifest lists every file of a checkpoint step with its size and sha256, plus
what a resume needs to continue exactly where the run stopped (topology, data
position, spec hash). It is written last, so a reader that sees it may trust
that every file it names was uploaded completely.

This module is pure data: it never touches storage or the network, and it never
accepts a file path that could escape the step directory when downloaded.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from spotline.heap import collection_held
from spotline.storage import UnsafePathError
from spotline.storage import check_relpath as check_entry_path

FORMAT_VERSION = 1
"""Manifest layout written by this code; a newer one is refused, not guessed at."""

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_REQUIRED_FIELDS = ("step", "files", "topology", "data_position", "spec_hash", "created_at")


class ManifestError(ValueError):
    """A manifest (or a file entry) that is malformed or was written by a newer Spotline."""


SIGNATURE_FIELD = "signature"
RESERVED_NAMES = frozenset({"manifest.json", "checked.json", "quarantine.json"})
"""The commit records at the top of a step's folder: no checkpoint file takes their name."""


def _canonical(raw: dict) -> bytes:
    return json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()


def sign(raw: dict, key: bytes) -> str:
    """HMAC-SHA256 of a manifest's canonical JSON (without its signature), hex."""
    body = {k: v for k, v in raw.items() if k != SIGNATURE_FIELD}
    return hmac.new(key, _canonical(body), hashlib.sha256).hexdigest()


def verify(raw: dict, key: bytes | None, what: str, written: str) -> None:
    """Check and drop the signature of a parsed record (a manifest, a receipt) before
    any field of it is trusted; ManifestError naming `what` when a key is set and the
    record is unsigned or signed otherwise. `written`: what happened to it ("committed")."""
    signature = raw.pop(SIGNATURE_FIELD, None)
    if key is None:
        return
    if not isinstance(signature, str):
        raise ManifestError(
            f"{what} is not signed, and checkpoint.signing_key_env is set: it was "
            "written without the key (or by someone who does not hold it)"
        )
    if not hmac.compare_digest(signature, sign(raw, key)):
        raise ManifestError(
            f"{what} signature does not verify with the key in checkpoint.signing_key_env: "
            f"it was changed after it was {written}, or signed with another key"
        )


def _dump_signed(raw: dict, key: bytes | None) -> str:
    if key is not None:
        raw[SIGNATURE_FIELD] = sign(raw, key)
    return json.dumps(raw, sort_keys=True)


def _load_signed(s: str | bytes, key: bytes | None, what: str, written: str) -> dict:
    """The JSON object of a signed record, its signature checked (see `verify`) and
    dropped; ManifestError naming `what` when it is not a JSON object."""
    try:
        raw = json.loads(s)
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"{what} is not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ManifestError(f"{what} must be a JSON object (got {type(raw).__name__})")
    verify(raw, key, what, written)
    return raw


def dump_signed(raw: dict, key: bytes | None) -> str:
    """A small record (a file check) as JSON, signed when `key` is set."""
    return _dump_signed(raw, key)


def load_signed(s: str | bytes, key: bytes | None, what: str, written: str) -> dict:
    """A small signed record read back (see `verify`); ManifestError when it is not a
    JSON object or does not verify."""
    return _load_signed(s, key, what, written)


def check_relpath(path: str) -> str:
    """Return ``path`` if it is a safe relative posix path inside a step directory.

    Manifests come from storage that other programs can write to; a path such as
    ``../../etc/x`` or ``/abs`` would make a download write outside its directory.
    """
    try:
        check_entry_path(path)
    except UnsafePathError as e:
        raise ManifestError(
            f"checkpoint file path {path!r} {e.why} (it must be a relative path inside the "
            "step directory)"
        ) from None
    if path in RESERVED_NAMES:
        raise ManifestError(f"{path!r} is reserved for the commit records of a step")
    return path


def check_index_files(index: object, where: str) -> None:
    """Refuse a sharded-state index (a list of entries whose "file" a restore reads)
    when an entry's file would leave the step directory; `where` names the record."""
    if not isinstance(index, list):
        raise ManifestError(f"{where}: 'index' must be a list (got {type(index).__name__})")
    checked: set[str] = set()  # a rank's entries share its file: each one checked once
    for i, e in enumerate(index):
        path = e.get("file") if isinstance(e, dict) else None
        if isinstance(path, str) and path in checked:
            continue
        try:
            checked.add(check_entry_path(path))
        except UnsafePathError as err:
            raise ManifestError(
                f"{where}: index entry {i} file {path!r} {err.why} (it must be a relative path "
                "inside the step directory)"
            ) from None


def _step_losses(losses: object) -> bool:
    """True when `losses` is a list of [step, loss] pairs (an int and a number)."""
    return isinstance(losses, list) and all(
        isinstance(p, list)
        and len(p) == 2
        and isinstance(p[0], int)
        and not isinstance(p[0], bool)
        and isinstance(p[1], (int, float))
        and not isinstance(p[1], bool)
        for p in losses
    )


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint step."""

    path: str
    """Path relative to the step directory, posix separators,
    e.g. ``rank_0/global_step100/mp_rank_00_model_states.pt``."""
    size: int
    """Size in bytes."""
    sha256: str
    """Lower-case hex sha256 of the file's content."""

    def __post_init__(self) -> None:
        check_relpath(self.path)
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 0:
            raise ManifestError(f"size of {self.path!r} must be an int >= 0 (got {self.size!r})")
        if not isinstance(self.sha256, str) or not _SHA256_RE.match(self.sha256):
            raise ManifestError(
                f"sha256 of {self.path!r} must be 64 lower-case hex digits (got {self.sha256!r})"
            )


@dataclass
class Manifest:
    """The commit record of one checkpoint step."""

    step: int
    """Training step the checkpoint was taken after (the next step to run is in data_position)."""
    files: list[FileEntry]
    """Every file of the step; a restore downloads and verifies exactly these."""
    topology: dict
    """Parallel layout at save time, e.g.
    ``{"pipeline_stages": 2, "replicas": 2, "world_size": 4, "zero_stage": 1}``;
    a restore with another layout must reshard."""
    data_position: dict
    """Where the sampler resumes, e.g. ``{"next_step": 100, "seed": 1234}``."""
    spec_hash: str
    """``JobSpec.spec_hash()`` of the run that wrote it; a different hash must not resume."""
    created_at: float
    """Unix time the manifest was written."""
    extra: dict = field(default_factory=dict)
    """Anything else a resume needs (global batch policy, universal checkpoint info, ...)."""
    format_version: int = FORMAT_VERSION
    """Layout version of this manifest."""

    def __post_init__(self) -> None:
        if not isinstance(self.step, int) or isinstance(self.step, bool) or self.step < 0:
            raise ManifestError(f"manifest step must be an int >= 0 (got {self.step!r})")
        seen: set[str] = set()
        for f in self.files:
            if not isinstance(f, FileEntry):
                raise ManifestError(f"manifest files must be FileEntry objects (got {f!r})")
            if f.path in seen:
                raise ManifestError(f"manifest of step {self.step} lists {f.path!r} twice")
            seen.add(f.path)
        if "index" in self.extra:
            check_index_files(self.extra["index"], f"manifest of step {self.step}")

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self, signing_key: bytes | None = None) -> str:
        """The manifest as JSON; with a key, signed with HMAC-SHA256 (see `from_json`).
        On one line: a manifest of thousands of ranks is megabytes, which json writes
        several times faster (and a third smaller) without indentation; `jq .` shows it
        indented. Automatic collection waits meanwhile (`spotline.heap`)."""
        with collection_held():
            return self._to_json(signing_key)

    def _to_json(self, signing_key: bytes | None) -> str:
        raw = {
            "step": self.step,
            "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in self.files],
            "topology": self.topology,
            "data_position": self.data_position,
            "spec_hash": self.spec_hash,
            "created_at": self.created_at,
            "extra": self.extra,
            "format_version": self.format_version,
        }
        return _dump_signed(raw, signing_key)

    @classmethod
    def from_json(cls, s: str | bytes, signing_key: bytes | None = None) -> Manifest:
        """Parse (and, with a key, verify) a manifest. The signature is checked before any
        field is trusted, so a manifest written by whoever can write the bucket but does
        not hold the key is refused before a single file it names is read. Automatic
        collection waits meanwhile: a manifest of thousands of ranks is tens of thousands
        of containers (`spotline.heap`)."""
        with collection_held():
            return cls._from_json(s, signing_key)

    @classmethod
    def _from_json(cls, s: str | bytes, signing_key: bytes | None) -> Manifest:
        raw = _load_signed(s, signing_key, "manifest", "committed")
        version = raw.get("format_version", FORMAT_VERSION)
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ManifestError(
                f"manifest format_version {version!r} is newer than this Spotline understands "
                f"({FORMAT_VERSION}); upgrade spotline to resume from it"
            )
        missing = [k for k in _REQUIRED_FIELDS if k not in raw]
        if missing:
            raise ManifestError(f"manifest is missing field(s) {', '.join(missing)}")
        files_raw: Any = raw["files"]
        if not isinstance(files_raw, list):
            raise ManifestError("manifest 'files' must be a list")
        try:
            files = [
                FileEntry(path=f["path"], size=f["size"], sha256=f["sha256"]) for f in files_raw
            ]
        except (KeyError, TypeError) as e:
            raise ManifestError(f"manifest file entry is malformed ({e!r})") from e
        for key in ("topology", "data_position", "extra"):
            if not isinstance(raw.get(key, {}), dict):
                raise ManifestError(f"manifest {key!r} must be a JSON object")
        try:
            created_at = float(raw["created_at"])
        except (TypeError, ValueError) as e:
            raise ManifestError(f"manifest created_at must be a number ({e})") from e
        return cls(
            step=raw["step"],
            files=files,
            topology=raw["topology"],
            data_position=raw["data_position"],
            spec_hash=str(raw["spec_hash"]),
            created_at=created_at,
            extra=raw.get("extra", {}),
            format_version=version,
        )


@dataclass(frozen=True)
class Receipt:
    """One rank's record that it finished uploading its files of a step.

    A restarted controller commits a step from its receipts alone, so a receipt is
    signed like a manifest and names the job and spec that wrote it: one planted in
    the bucket, or left by a run of another spec, never becomes a commit."""

    job: str
    """The name of the job whose rank wrote it."""
    spec_hash: str
    """``JobSpec.spec_hash()`` of that job; a job with another hash never commits it."""
    spec: dict
    """That job's ``hashed_fields``, so a refusal can say which fields changed."""
    step: int
    attempt: str
    """The group (attempt) the rank belonged to; a step commits from one group only."""
    rank: int
    world_size: int
    files: list[FileEntry]
    index: list[dict] = field(default_factory=list)
    """Where each saved tensor lies (file, byte range, sha256)."""
    batch: dict | None = None
    """The adaptive batch schedule the rank saved, if any."""
    losses: list = field(default_factory=list)
    """[step, loss] of each step the rank trained since its previous save (rank 0's
    only): a step committed from receipts keeps the losses its group never reported."""
    meta: dict | None = None
    """What of the rank's meta every rank must agree on (`reshard.shared_meta`): the
    manifest records them combined, so a restoring rank reads no other rank's meta file."""

    def to_json(self, signing_key: bytes | None = None) -> str:
        return _dump_signed(asdict(self), signing_key)

    @classmethod
    def from_json(cls, s: str | bytes, signing_key: bytes | None = None) -> Receipt:
        """Parse (and, with a key, verify) a receipt; ManifestError when it is malformed
        or its signature does not verify."""
        raw = _load_signed(s, signing_key, "receipt", "written")
        try:
            files = [FileEntry(f["path"], f["size"], f["sha256"]) for f in raw["files"]]
            receipt = cls(
                job=raw["job"],
                spec_hash=raw["spec_hash"],
                spec=raw["spec"],
                step=raw["step"],
                attempt=raw["attempt"],
                rank=raw["rank"],
                world_size=raw["world_size"],
                files=files,
                index=raw.get("index") or [],
                batch=raw.get("batch"),
                losses=raw.get("losses") or [],
                meta=raw.get("meta"),
            )
        except (KeyError, TypeError) as e:
            raise ManifestError(
                f"receipt is malformed or written by an older Spotline (field {e})"
            ) from e
        ints = (receipt.step, receipt.rank, receipt.world_size)
        strs = (receipt.job, receipt.spec_hash, receipt.attempt)
        if (
            not all(isinstance(v, int) and not isinstance(v, bool) for v in ints)
            or not all(isinstance(v, str) for v in strs)
            or not isinstance(receipt.spec, dict)
            or not isinstance(receipt.index, list)
            or not isinstance(receipt.meta, (dict, type(None)))
            or not _step_losses(receipt.losses)
            or not 0 <= receipt.rank < receipt.world_size
        ):
            raise ManifestError("receipt has a field of the wrong type or out of range")
        check_index_files(receipt.index, "receipt")
        return receipt
