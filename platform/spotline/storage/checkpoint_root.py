"""A checkpoint root as storage: its URI, its backend, its filesystem, where each file of
the commit protocol lies under it, and a storage failure in words.

Layout under the root URI (``file://`` or ``s3://``)::

    <root>/step_00000100/<files of the step...>
    <root>/step_00000100/_receipts/<attempt>/rank_0000N.json   <- signed upload receipts
    <root>/step_00000100/manifest.json      <- written last: the commit
    <root>/step_00000100/checked.json       <- the manifest's files were listed present
    <root>/step_00000100/quarantine.json    <- the step failed verification (kept aside)
    <root>/artifacts/<name>                 <- the job's artifacts, outside every step

`StepStorage` is what the modules above it share (uploads, reads, the catalog of
steps, probes, retention, and the `CheckpointStore` facade): it never decides which
step is committed, good or due for deletion, and it never reads a path a manifest
holds (the checkpoint modules do, through `storage.join_under`). Retries go through
the one retry policy (`storage.retry`), only for what `retry.is_transient` says may
pass.

Optional S3 packages are imported only when an ``s3://`` URI is used; the settings
pickle without the filesystem client, which each process rebuilds on first use.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

from spotline import constants
from spotline.storage.backends import URI_SCHEME_RE, Backend, LocalBackend, bad_uri
from spotline.storage.errors import SPEC_FIELDS, StorageError, StoreFields
from spotline.storage.retry import retrying
from spotline.storage.s3 import S3_MIN_PART_BYTES, S3Backend

MANIFEST_NAME = "manifest.json"
ARTIFACTS_DIR = "artifacts"
RECEIPTS_DIR = "_receipts"  # per-rank upload receipts; not part of the checkpoint
QUARANTINE_NAME = "quarantine.json"  # a step that failed verification: why, and its manifest
CHECKED_NAME = "checked.json"  # the files a manifest names were listed present in storage
MIN_SIGNING_KEY_BYTES = 16

BACKENDS: dict[str, type[Backend]] = {"file": LocalBackend, "s3": S3Backend}
"""Storage backends by URI scheme; a plain path means 'file'."""


def make_backend(uri: str, endpoint_url: str | None, options: dict, fields: StoreFields) -> Backend:
    """The backend of `uri` (StorageError naming `fields.uri` when it is not usable)."""
    if not isinstance(uri, str) or not uri.strip():
        raise bad_uri(uri, "it is empty", fields)
    uri = uri.strip()
    if "://" in uri:
        scheme, rest = uri.split("://", 1)
        backend = BACKENDS.get(scheme.lower())
        if backend is None:
            raise bad_uri(
                uri,
                f"unknown scheme {scheme + '://'!r} (supported schemes: "
                f"{', '.join(s + '://' for s in BACKENDS)})",
                fields,
            )
        return backend(uri, rest, False, endpoint_url, options, fields)
    if URI_SCHEME_RE.match(uri):
        scheme = uri.split(":", 1)[0]
        raise bad_uri(uri, f"it starts with '{scheme}:' but has no '//' after it", fields)
    return LocalBackend(uri, uri, True, endpoint_url, options, fields)


class StepStorage:
    """Checkpoint steps under one root URI, as storage: paths, the filesystem, errors.

    Safe to pickle (Ray ships it to workers); the filesystem client is rebuilt on
    first use in each process. Safe to call from several threads.
    """

    def __init__(
        self,
        uri: str,
        endpoint_url: str | None = None,
        storage_options: dict | None = None,
        *,
        multipart_chunksize: int | None = None,
        signing_key_env: str | None = None,
        fields: StoreFields = SPEC_FIELDS,
    ) -> None:
        """
        Args:
            uri: ``file:///abs``, ``file://./relative`` (resolved against the current
                working directory now), a plain local path, or ``s3://bucket/prefix``.
            endpoint_url: S3 only; an S3-compatible endpoint (MinIO, a test server).
            storage_options: extra keyword arguments for the fsspec filesystem
                (for S3: ``key``/``secret``/``profile``/``anon``/``client_kwargs``...).
            multipart_chunksize: S3 only; part size in bytes for multipart uploads
                (larger files go multipart). Default: 8 MiB, as boto3's.
            signing_key_env: name of an environment variable holding the manifest
                signing key (read in each process that commits or restores; the key is
                never pickled, stored or logged).
            fields: what the URI, endpoint and options are called in messages (the
                spec's checkpoint fields, or `StoreFields.argument(...)` for the CLI).
        """
        self._backend = make_backend(uri, endpoint_url, storage_options or {}, fields)
        self.fields = fields
        if multipart_chunksize is not None:
            if multipart_chunksize < S3_MIN_PART_BYTES:
                raise ValueError(
                    f"multipart_chunksize must be >= {S3_MIN_PART_BYTES} bytes (5 MiB, the "
                    f"smallest part S3 accepts); got {multipart_chunksize}"
                )
            if isinstance(self._backend, S3Backend):
                self._backend.multipart_chunksize = multipart_chunksize
        self._multipart_chunksize = multipart_chunksize
        self.signing_key_env = signing_key_env
        self._fs: Any = None
        self._fs_lock = threading.Lock()
        self.verdicts: dict[int, tuple[Any, str | None]] = {}
        """What the catalog made of each step's manifest the last time it read it: step ->
        (what identified the manifest, what is wrong with it or None). Never pickled."""
        self.newest_manifest: tuple[Any, Any] | None = None
        """The newest manifest the catalog verified, parsed, with what identified it
        then: one manifest, not one per step (thousands of ranks make each tens of MB in
        memory). Never pickled."""
        self.manifest_sha: dict[int, str] = {}
        """sha256 of each step's manifest as this object last wrote or read it: what a
        `checked.json` names. Never pickled."""
        self.owner: Any = None
        """Whose steps count as committed here (`CheckpointStore.of_job`): a manifest of
        another job or spec is damaged, not committed. None: any job's. Never pickled."""
        self.records_checks = False
        """Whether a listing that finds a manifest's files present writes its
        `checked.json` (only the commit coordinator's store does). Never pickled."""

    # Pickling sends the arguments and rebuilds the client lazily on the other side;
    # the normalized URI goes, so a relative file:// path keeps meaning the same place.
    def __getstate__(self) -> dict:
        b = self._backend
        return {
            "args": (self.uri, b.endpoint_url, b.options, self._multipart_chunksize),
            "signing_key_env": self.signing_key_env,
            "fields": tuple(self.fields),
        }

    def __setstate__(self, state: dict) -> None:
        uri, endpoint_url, options, chunk = state["args"]
        self.__init__(  # type: ignore[misc]
            uri,
            endpoint_url,
            options,
            multipart_chunksize=chunk,
            signing_key_env=state.get("signing_key_env"),
            fields=StoreFields(*state.get("fields", SPEC_FIELDS)),
        )

    def signing_key(self) -> bytes | None:
        """The manifest signing key from the environment; None when signing is off."""
        name = self.signing_key_env
        if name is None:
            return None
        value = os.environ.get(name, "")
        if len(value.encode()) < MIN_SIGNING_KEY_BYTES:
            state = "is not set" if not value else f"holds fewer than {MIN_SIGNING_KEY_BYTES} bytes"
            raise StorageError(
                f"checkpoint.signing_key_env names {name}, which {state} in this process "
                f"(on {socket.gethostname()}); set it to a secret of at least "
                f"{MIN_SIGNING_KEY_BYTES} bytes on every node and in the driver (e.g. "
                "`openssl rand -hex 32`), or remove checkpoint.signing_key_env"
            )
        return value.encode()

    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def uri(self) -> str:
        """Normalized root URI: ``file:///abs/path`` or ``s3://bucket/prefix``."""
        return self._backend.uri

    @property
    def endpoint_url(self) -> str | None:
        return self._backend.endpoint_url

    @property
    def is_local(self) -> bool:
        return isinstance(self._backend, LocalBackend)

    def root_missing(self) -> bool:
        """True when the root is a local directory that does not exist (an object store
        has no directories: an empty prefix is simply empty)."""
        return self.is_local and not os.path.exists(self._backend.root)

    @property
    def fs(self) -> Any:
        """The fsspec filesystem (created on first use)."""
        if self._fs is None:
            with self._fs_lock:
                if self._fs is None:
                    self._fs = self._backend.make_fs()
        return self._fs

    # --- where things lie ---------------------------------------------------------------

    @staticmethod
    def step_name(step: int) -> str:
        return f"step_{step:08d}"

    def step_uri(self, step: int) -> str:
        """Full URI of a step's directory, for messages and logs."""
        return f"{self._backend.scheme}://{self.step_path(step)}"

    def step_path(self, step: int) -> str:
        return f"{self._backend.root}/{self.step_name(step)}"

    def manifest_path(self, step: int) -> str:
        return f"{self.step_path(step)}/{MANIFEST_NAME}"

    def quarantine_path(self, step: int) -> str:
        return f"{self.step_path(step)}/{QUARANTINE_NAME}"

    def checked_path(self, step: int) -> str:
        return f"{self.step_path(step)}/{CHECKED_NAME}"

    def full_uri(self, path: str) -> str:
        """The URI of a path inside the filesystem, for messages and callers."""
        return f"{self._backend.scheme}://{path}"

    # --- calls into storage ---------------------------------------------------------------

    @contextlib.contextmanager
    def io(self, action: str, passthrough: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
        """Turn a storage failure into a StorageError that says what failed and how to fix it."""
        try:
            yield
        except StorageError:
            raise
        except passthrough:
            raise
        except self._backend.storage_errors() as e:
            raise StorageError(f"{action} at {self.uri} failed: {self._backend.explain(e)}") from e

    def retrying(self, fn: Callable[[], Any]) -> Any:
        """Run a storage call, retrying what may pass (`retry.is_transient`: a dropped
        connection, a timeout, a throttle) through the one retry policy; the last error
        goes up."""
        return retrying(fn, constants.SPOTLINE_STORAGE_RETRIES)

    def write_atomic(self, path: str, data: bytes) -> None:
        """Write `data` at `path` so that a reader sees all of it or nothing."""
        self._backend.write_atomic(self.fs, path, data)
