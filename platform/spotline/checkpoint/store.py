"""Checkpoint storage: upload step files, commit them with a manifest, restore the newest good one.

Layout under the root URI (``file://`` or ``s3://``)::

    <root>/step_00000100/<files of the step...>
    <root>/step_00000100/_receipts/<attempt>/rank_0000N.json   <- signed upload receipts
    <root>/step_00000100/manifest.json      <- written last: the commit
    <root>/step_00000100/quarantine.json    <- the step failed verification (kept aside)

A step directory without ``manifest.json`` is an upload in progress, an abandoned
one or a quarantined one; it is never restored. Every restored file is checked against the size and
sha256 in the manifest before it is used.

This module must never hand back a checkpoint it has not verified, never delete an
upload that may still be running (an uncommitted step newer than the newest
commit), and never let a reader see a manifest whose files are gone (the manifest
is deleted first). Optional S3 packages are imported only when an ``s3://`` URI is
used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import posixpath
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, NamedTuple

from spotline import constants
from spotline.checkpoint.manifest import (
    MIN_SIGNING_KEY_BYTES,
    FileEntry,
    Manifest,
    ManifestError,
    Receipt,
    check_relpath,
)
from spotline.config.identity import foreign_job, mismatch_reason, resumable_by
from spotline.config.redact import redact
from spotline.storage import UnsafePathError, join_under
from spotline.storage.fs import (
    FSSPEC_COMMON_OPTIONS,
    HASH_CHUNK_BYTES,
    StorageOptionsError,
    check_s3_options,
    hash_file,
)

log = logging.getLogger("spotline.checkpoint")

MANIFEST_NAME = "manifest.json"
ARTIFACTS_DIR = "artifacts"
# The job's artifacts beside its checkpoints (see write_artifact).
TRACE_ARTIFACT = "trace.json"  # Chrome trace of the latest pipeline steps
SUMMARY_ARTIFACT = "summary.json"  # what `spotline status` / `report` show
LEDGER_ARTIFACT = "ledger.json"  # the goodput ledger, continued by a restarted controller
RECEIPTS_DIR = "_receipts"  # per-rank upload receipts; not part of the checkpoint
QUARANTINE_NAME = "quarantine.json"  # a step that failed verification: why, and its manifest
# Files of one step move in parallel; each large S3 object is itself split into
# concurrent parts by s3fs, so a few threads are enough to fill the link.
TRANSFER_THREADS = 4
# S3 refuses multipart parts smaller than this (except the last one).
S3_MIN_PART_BYTES = 5 * 2**20
# S3 uploads: part size and parts in flight per file (boto3's defaults). boto3 raises
# the part size itself when a file would need more than S3's 10,000 parts.
DEFAULT_PART_BYTES = 8 * 2**20
PART_THREADS = 10
# s3fs options with a boto3 equivalent, and the credentials among them.
_BOTO3_CREDENTIALS = {
    "key": "aws_access_key_id",
    "username": "aws_access_key_id",
    "secret": "aws_secret_access_key",
    "password": "aws_secret_access_key",
    "token": "aws_session_token",
}
_BOTO3_MAPPABLE = {*_BOTO3_CREDENTIALS, "profile", "anon", "client_kwargs", "config_kwargs"}

SUPPORTED_URI_FORMS = (
    "file:///absolute/path",
    "file://./relative/path (relative to the working directory)",
    "a plain local path such as /data/ckpt or ./ckpt",
    "s3://bucket/prefix",
)
_STEP_RE = re.compile(r"^step_(\d{8,})$")
_URI_SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_S3_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class StoreFields(NamedTuple):
    """What a store's settings are called in its messages: the spec's fields by default,
    or the command-line arguments that gave them (`argument`), so that a message names
    what the user actually typed."""

    uri: str = "checkpoint.uri"
    endpoint_url: str = "checkpoint.endpoint_url"
    storage_options: str | None = "checkpoint.storage_options"

    @classmethod
    def argument(cls, name: str) -> StoreFields:
        """A store named by the command-line argument `name` (no storage options)."""
        return cls(uri=f"the {name} argument", endpoint_url="--endpoint-url", storage_options=None)

    def credentials_fix(self) -> str:
        fix = "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an instance role"
        if self.storage_options:
            fix += f", or put key/secret (or profile) in {self.storage_options}"
        return fix


SPEC_FIELDS = StoreFields()


class StorageError(RuntimeError):
    """The checkpoint storage cannot be used: bad URI, unreachable, no credentials, no access.

    Worth retrying when it is an outage (unreachable, timed out); not when it is a bad
    URI, missing credentials or refused access. The message never holds a secret.
    """

    def __init__(self, message: str) -> None:
        super().__init__(redact(message))


class CheckpointMismatchError(ValueError):
    """The checkpoint URI holds checkpoints this job must not resume or write over (another
    job's, or this job's with a different model, data or training spec). Not retryable."""


@dataclasses.dataclass
class ReceiptScan:
    """The upload receipts found under one step."""

    receipts: dict[str, list[Receipt]] = dataclasses.field(default_factory=dict)
    """Those that parsed and verified, by the attempt (group) that wrote them."""
    refused: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """(path under the step, why) of each one that can never complete a commit."""
    attempts: set[str] = dataclasses.field(default_factory=set)
    """Every attempt with a receipt there, refused ones included."""


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file is missing or its size/sha256 differs from the manifest.

    ``step`` and ``path`` name the first bad file; ``failures`` lists every
    ``(step, path, reason)`` found when several steps were tried.
    """

    def __init__(
        self,
        step: int,
        path: str,
        reason: str,
        *,
        uri: str = "",
        message: str | None = None,
        failures: list[tuple[int, str, str]] | None = None,
    ) -> None:
        self.step = step
        self.path = path
        self.reason = reason
        self.uri = uri
        self.failures = failures or [(step, path, reason)]
        where = f" at {uri}" if uri else ""
        super().__init__(message or f"checkpoint step {step}{where} is corrupt: {path}: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Ray ships exceptions between processes; the default reduce would call
        # __init__ with the message only.
        return (
            _rebuild_corrupt,
            (self.step, self.path, self.reason, self.uri, str(self), self.failures),
        )


def _rebuild_corrupt(
    step: int, path: str, reason: str, uri: str, message: str, failures: list
) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        step, path, reason, uri=uri, message=message, failures=[tuple(f) for f in failures]
    )


def _fsync(path: str) -> None:
    """Flush a local file's (or directory's) data and metadata to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _bad_uri(uri: object, why: str, fields: StoreFields) -> StorageError:
    forms = "; ".join(SUPPORTED_URI_FORMS)
    return StorageError(f"{fields.uri} {uri!r} is not usable: {why}. Supported forms: {forms}")


def _run_with_deadline(fn: Callable[[], Any], timeout_s: float) -> Any:
    """Run ``fn`` in a daemon thread; raise TimeoutError if it has not finished in time.

    A hung NFS mount or a black-holed endpoint must not hang the caller; the stuck
    thread is abandoned (daemon, so it never blocks interpreter exit).
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=target, name="spotline-storage-check", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("result")


def _exception_chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


# --- backends ---------------------------------------------------------------------


class _Backend:
    """One storage scheme: URI parsing, filesystem construction and error wording."""

    scheme = ""

    def __init__(
        self,
        uri: str,
        rest: str,
        bare: bool,
        endpoint_url: str | None,
        options: dict,
        fields: StoreFields,
    ) -> None:
        self.fields = fields
        self.endpoint_url = endpoint_url
        self.options = dict(options)
        self.uri = ""  # normalized, set by subclasses
        self.root = ""  # path inside the filesystem, no scheme, no trailing '/'

    def make_fs(self, probe_timeout_s: float | None = None) -> Any:
        raise NotImplementedError

    def put_file(self, fs: Any, local: str, remote: str) -> None:
        """Upload one local file to `remote` (a path inside the filesystem)."""
        fs.put_file(local, remote)

    def write_atomic(self, fs: Any, path: str, data: bytes) -> None:
        raise NotImplementedError

    def check_credentials(self) -> None:
        return None

    def storage_errors(self) -> tuple[type[BaseException], ...]:
        return (OSError,)

    def transient_errors(self) -> tuple[type[BaseException], ...]:
        """Errors worth retrying: the storage may answer the same call next time."""
        return (TimeoutError, ConnectionError, InterruptedError)

    def explain(self, exc: BaseException) -> str:
        raise NotImplementedError


class _LocalBackend(_Backend):
    """file:// and plain paths. Shared by all nodes only if the path is on a shared mount."""

    scheme = "file"

    def __init__(
        self,
        uri: str,
        rest: str,
        bare: bool,
        endpoint_url: str | None,
        options: dict,
        fields: StoreFields,
    ) -> None:
        super().__init__(uri, rest, bare, endpoint_url, options, fields)
        f = fields
        if endpoint_url:
            raise StorageError(
                f"{f.endpoint_url} ({endpoint_url!r}) is set but {f.uri} {uri!r} is a local "
                "path; an endpoint URL only applies to s3:// URIs (did you mean "
                "s3://bucket/prefix?)"
            )
        if options:
            # LocalFileSystem would take them and ignore them: a typo'd s3 option, or
            # credentials meant for another URI, must not pass silently.
            raise StorageError(
                f"{f.storage_options} ({', '.join(sorted(map(str, options)))}) are set "
                f"but {f.uri} {uri!r} is a local path, which takes none; remove them, "
                f"or make {f.uri} an s3:// URI"
            )
        if bare:
            path = os.path.expanduser(rest)
        elif rest.startswith("/"):
            path = rest
        elif rest.startswith("localhost/"):
            path = rest[len("localhost") :]
        elif rest in (".", "..") or rest.startswith(("./", "../", "~")):
            path = os.path.expanduser(rest)
        elif not rest:
            raise _bad_uri(uri, "'file://' is followed by no path", f)
        else:
            raise _bad_uri(
                uri,
                f"'file://{rest}' names no absolute path; write file:///{rest} for the "
                f"absolute path /{rest} or file://./{rest} for a path relative to the "
                "working directory",
                f,
            )
        self.root = os.path.normpath(os.path.abspath(path))
        self.uri = "file://" + self.root

    def make_fs(self, probe_timeout_s: float | None = None) -> Any:
        from fsspec.implementations.local import LocalFileSystem

        return LocalFileSystem(auto_mkdir=True)

    def put_file(self, fs: Any, local: str, remote: str) -> None:
        # The manifest that names this file may be written as soon as its receipt is:
        # the file's bytes, and each directory entry that leads to it, must be on disk
        # before then, or a crash could leave a committed step with a torn file.
        fs.put_file(local, remote)
        _fsync(remote)
        self._fsync_dirs(remote)

    def write_atomic(self, fs: Any, path: str, data: bytes) -> None:
        # Readers list the directory at any moment: they must see either no
        # manifest or the whole one, so write aside, fsync, then rename over.
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        self._fsync_dirs(path)

    def _fsync_dirs(self, path: str) -> None:
        """fsync every directory from `path`'s own up to the root: a directory created
        on the way (the step's, the rank's) holds the entry that makes the file findable."""
        directory = os.path.dirname(path)
        while True:
            _fsync(directory)
            parent = os.path.dirname(directory)
            inside = directory.startswith(self.root.rstrip("/") + "/")
            if directory == self.root or not inside or parent == directory:
                return
            directory = parent

    def explain(self, exc: BaseException) -> str:
        if isinstance(exc, TimeoutError):
            return (
                f"the filesystem at {self.root} {exc}; if it is a network mount, check "
                "that it is mounted and responding"
            )
        if isinstance(exc, PermissionError):
            return (
                f"permission denied under {self.root} ({exc}); point {self.fields.uri} at a "
                "directory this user can write, or fix its permissions"
            )
        if isinstance(exc, (NotADirectoryError, FileExistsError)):
            return (
                f"a path component of {self.root} is a file, not a directory ({exc}); "
                f"choose another {self.fields.uri}"
            )
        if isinstance(exc, OSError) and exc.errno is not None:
            return (
                f"{os.strerror(exc.errno)} ({exc}); free space or choose another {self.fields.uri}"
            )
        return f"{type(exc).__name__}: {exc}"


def _import_s3fs(fields: StoreFields = SPEC_FIELDS) -> Any:
    try:
        import s3fs
    except ImportError as e:
        raise StorageError(
            f"s3:// {fields.uri} needs the optional S3 packages, which are not installed "
            f"({e}); run: pip install 'spotline[s3]'"
        ) from e
    return s3fs


class _S3Backend(_Backend):
    """s3:// through s3fs (aiobotocore), with botocore's standard credential chain."""

    scheme = "s3"

    def __init__(
        self,
        uri: str,
        rest: str,
        bare: bool,
        endpoint_url: str | None,
        options: dict,
        fields: StoreFields,
    ) -> None:
        super().__init__(uri, rest, bare, endpoint_url, options, fields)
        f = fields
        if not rest or rest.startswith("/"):
            raise _bad_uri(uri, "no bucket name after 's3://'", f)
        if "?" in rest or "#" in rest:
            raise _bad_uri(uri, "query strings and fragments are not supported", f)
        bucket, _, prefix = rest.partition("/")
        if "@" in bucket:
            fix = f.credentials_fix()
            raise _bad_uri(uri, f"credentials in an s3:// URI are never read; {fix}", f)
        if not _S3_BUCKET_RE.match(bucket) or ".." in bucket:
            raise _bad_uri(
                uri,
                f"{bucket!r} is not a valid S3 bucket name (3-63 lower-case letters, digits, "
                "'.' or '-', starting and ending with a letter or digit)",
                f,
            )
        parts = [p for p in prefix.split("/") if p]
        if any(p in (".", "..") for p in parts):
            raise _bad_uri(uri, "the prefix must not contain '.' or '..' segments", f)
        self.bucket = bucket
        self.root = "/".join([bucket, *parts])
        self.uri = "s3://" + self.root
        self.multipart_chunksize: int | None = None
        try:
            check_s3_options(self.options, f.storage_options or "storage options")
        except StorageOptionsError as e:
            raise StorageError(str(e)) from None
        self._client: Any = False  # False: not built yet; None: use s3fs
        self._client_lock = threading.Lock()
        self._extra_args: dict = {}

    def make_fs(self, probe_timeout_s: float | None = None) -> Any:
        s3fs = _import_s3fs(self.fields)
        opts = dict(self.options)
        client_kwargs = dict(opts.pop("client_kwargs", None) or {})
        if self.endpoint_url:
            client_kwargs["endpoint_url"] = self.endpoint_url
        config_kwargs = dict(opts.pop("config_kwargs", None) or {})
        if probe_timeout_s is not None:
            # A preflight must fail in seconds: short connect timeout, one retry.
            config_kwargs.update(
                connect_timeout=max(1.0, min(5.0, probe_timeout_s / 4)),
                read_timeout=max(1.0, probe_timeout_s),
                retries={"max_attempts": 2, "mode": "standard"},
            )
        # Listings must always be fresh: other processes commit and delete steps.
        opts.setdefault("use_listings_cache", False)
        try:
            fs = s3fs.S3FileSystem(
                client_kwargs=client_kwargs,
                config_kwargs=config_kwargs,
                skip_instance_cache=True,
                **opts,
            )
        except (TypeError, KeyError, ValueError) as e:
            raise StorageError(
                f"{self.fields.storage_options} ({', '.join(sorted(map(str, self.options)))}) "
                f"were refused by s3fs ({redact(str(e))}); fix or remove them"
            ) from e
        if probe_timeout_s is not None:
            fs.retries = 1  # s3fs's own retry loop, on top of botocore's
        return fs

    def put_file(self, fs: Any, local: str, remote: str) -> None:
        # boto3's managed transfer streams parts from 10 threads while it reads the file;
        # s3fs reads 10 parts, sends them from one event loop and waits for all before
        # reading on (0.6-0.8x the rate to the same server). Options boto3 cannot be
        # given the same way keep the s3fs path, so they are never silently dropped.
        client = self._upload_client()
        if client is None:
            chunk = self.multipart_chunksize
            fs.put_file(local, remote, **({"chunksize": chunk} if chunk else {}))
            return
        from boto3.s3.transfer import TransferConfig

        bucket, _, key = remote.partition("/")
        chunk = self.multipart_chunksize or DEFAULT_PART_BYTES
        config = TransferConfig(
            multipart_threshold=chunk, multipart_chunksize=chunk, max_concurrency=PART_THREADS
        )
        client.upload_file(
            local, bucket, key, ExtraArgs=dict(self._extra_args) or None, Config=config
        )

    def _upload_client(self) -> Any:
        """A boto3 client built from the same options as the s3fs filesystem, or None
        when boto3 is missing or an option has no boto3 equivalent."""
        with self._client_lock:
            if self._client is not False:
                return self._client
            self._client = None
            opts = dict(self.options)
            for name in FSSPEC_COMMON_OPTIONS:
                opts.pop(name, None)
            extra = dict(opts.pop("s3_additional_kwargs", None) or {})
            try:
                import boto3
                import botocore.config
                from boto3.s3.transfer import S3Transfer
            except ImportError:
                return None
            if set(extra) - set(S3Transfer.ALLOWED_UPLOAD_ARGS) or set(opts) - _BOTO3_MAPPABLE:
                return None
            client_kwargs = dict(opts.pop("client_kwargs", None) or {})
            config_kwargs = dict(opts.pop("config_kwargs", None) or {})
            config_kwargs.setdefault("max_pool_connections", TRANSFER_THREADS * PART_THREADS)
            if opts.pop("anon", False):
                import botocore

                config_kwargs["signature_version"] = botocore.UNSIGNED
            if self.endpoint_url:
                client_kwargs["endpoint_url"] = self.endpoint_url
            for ours, theirs in _BOTO3_CREDENTIALS.items():
                if opts.get(ours) is not None:
                    client_kwargs.setdefault(theirs, opts[ours])
            session = boto3.session.Session(profile_name=opts.get("profile"))
            self._client = session.client(
                "s3", config=botocore.config.Config(**config_kwargs), **client_kwargs
            )
            self._extra_args = extra
            return self._client

    def write_atomic(self, fs: Any, path: str, data: bytes) -> None:
        # One PUT (s3fs uses a single put_object below 2 chunks = 100 MiB) is atomic
        # and strongly consistent on S3: readers see the whole object or none.
        fs.pipe_file(path, data)

    def _where(self) -> str:
        return self.endpoint_url or "the default AWS S3 endpoint"

    def check_credentials(self) -> None:
        opts = self.options
        if opts.get("anon"):
            return
        client_kwargs = opts.get("client_kwargs") or {}
        if (opts.get("key") or opts.get("username") or client_kwargs.get("aws_access_key_id")) and (
            opts.get("secret") or opts.get("password") or client_kwargs.get("aws_secret_access_key")
        ):
            return
        _import_s3fs(self.fields)
        import botocore.exceptions
        import botocore.session

        profile = opts.get("profile")
        try:
            session = botocore.session.Session(profile=profile)
            creds = session.get_credentials()
        except botocore.exceptions.ProfileNotFound as e:
            raise StorageError(
                f"AWS profile {profile or os.environ.get('AWS_PROFILE')!r} for {self.uri} was "
                f"not found ({e}); fix the profile name in AWS_PROFILE or "
                f"{self.fields.storage_options}.profile, or add it to ~/.aws/config"
            ) from e
        except botocore.exceptions.BotoCoreError as e:
            raise StorageError(
                f"could not load AWS credentials for {self.uri} ({e}); "
                f"{self.fields.credentials_fix()}"
            ) from e
        if creds is None:
            raise StorageError(
                f"no AWS credentials found for {self.uri}: {self.fields.credentials_fix()}"
            )

    def storage_errors(self) -> tuple[type[BaseException], ...]:
        try:
            import botocore.exceptions
        except ImportError:
            return (OSError,)
        errors = (OSError, botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)
        try:
            from boto3.exceptions import S3UploadFailedError
        except ImportError:
            return errors
        return (*errors, S3UploadFailedError)

    def transient_errors(self) -> tuple[type[BaseException], ...]:
        # Connections that dropped or timed out; s3fs already retries throttling
        # and 5xx answers itself, and turns the rest into OSError subclasses.
        try:
            from botocore import exceptions as bx
        except ImportError:
            return super().transient_errors()
        return (
            *super().transient_errors(),
            bx.ConnectionError,
            bx.HTTPClientError,
            bx.ReadTimeoutError,
        )

    def explain(self, exc: BaseException) -> str:
        try:
            from botocore import exceptions as bx
        except ImportError:  # pragma: no cover - s3fs pulls botocore in
            bx = None
        for e in _exception_chain(exc):
            if bx is not None and isinstance(e, bx.NoCredentialsError):
                fix = self.fields.credentials_fix()
                return f"no AWS credentials found for {self.uri}: {fix}"
            if bx is not None and isinstance(
                e, (bx.ConnectionError, bx.HTTPClientError)
            ):  # refused, DNS, TLS, connect/read timeouts
                return (
                    f"cannot reach the S3 endpoint {self._where()} ({e}); check "
                    f"{self.fields.endpoint_url}, that the service is running, and the "
                    "network/firewall between this node and it"
                )
            if isinstance(e, TimeoutError):
                return (
                    f"the S3 endpoint {self._where()} gave {e}; check {self.fields.endpoint_url} "
                    "and the network, or raise SPOTLINE_STORAGE_CHECK_TIMEOUT_S"
                )
            code = _client_error_code(e, bx)
            if isinstance(e, PermissionError) or code in ("AccessDenied", "403"):
                return (
                    f"access denied by {self._where()} ({e}); check that the credentials are "
                    "valid and allow s3:PutObject, s3:GetObject, s3:DeleteObject and "
                    f"s3:ListBucket on arn:aws:s3:::{self.bucket} and "
                    f"arn:aws:s3:::{self.root}/*"
                )
            if isinstance(e, FileNotFoundError) or code in ("NoSuchBucket", "404"):
                return (
                    f"bucket {self.bucket!r} does not exist at {self._where()} or is not "
                    f"visible to these credentials ({e}); create it (e.g. `aws s3 mb "
                    f"s3://{self.bucket}`) or fix {self.fields.uri} / {self.fields.endpoint_url}"
                )
        return f"{type(exc).__name__}: {exc}"


def _client_error_code(exc: BaseException, bx: Any) -> str | None:
    """The S3 error code of a botocore ClientError (boto3 uploads raise them raw)."""
    if bx is None or not isinstance(exc, bx.ClientError):
        return None
    return str(exc.response.get("Error", {}).get("Code", "")) or None


_BACKENDS: dict[str, type[_Backend]] = {"file": _LocalBackend, "s3": _S3Backend}
"""Storage backends by URI scheme; a plain path means 'file'."""


def _make_backend(
    uri: str, endpoint_url: str | None, options: dict, fields: StoreFields
) -> _Backend:
    if not isinstance(uri, str) or not uri.strip():
        raise _bad_uri(uri, "it is empty", fields)
    uri = uri.strip()
    if "://" in uri:
        scheme, rest = uri.split("://", 1)
        backend = _BACKENDS.get(scheme.lower())
        if backend is None:
            raise _bad_uri(
                uri,
                f"unknown scheme {scheme + '://'!r} (supported schemes: "
                f"{', '.join(s + '://' for s in _BACKENDS)})",
                fields,
            )
        return backend(uri, rest, False, endpoint_url, options, fields)
    if _URI_SCHEME_RE.match(uri):
        scheme = uri.split(":", 1)[0]
        raise _bad_uri(uri, f"it starts with '{scheme}:' but has no '//' after it", fields)
    return _LocalBackend(uri, uri, True, endpoint_url, options, fields)


# --- the store ----------------------------------------------------------------------


class CheckpointStore:
    """Checkpoint steps under one root URI: upload, commit, list, restore, retain.

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
        self._backend = _make_backend(uri, endpoint_url, storage_options or {}, fields)
        self.fields = fields
        if multipart_chunksize is not None:
            if multipart_chunksize < S3_MIN_PART_BYTES:
                raise ValueError(
                    f"multipart_chunksize must be >= {S3_MIN_PART_BYTES} bytes (5 MiB, the "
                    f"smallest part S3 accepts); got {multipart_chunksize}"
                )
            if isinstance(self._backend, _S3Backend):
                self._backend.multipart_chunksize = multipart_chunksize
        self._multipart_chunksize = multipart_chunksize
        self.signing_key_env = signing_key_env
        self._fs: Any = None
        self._fs_lock = threading.Lock()

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

    def sibling(self, uri: str) -> CheckpointStore:
        """A store at another root URI with this one's endpoint, storage options and
        signing key (a checkpoint.resume_from source)."""
        b = self._backend
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

    @property
    def uri(self) -> str:
        """Normalized root URI: ``file:///abs/path`` or ``s3://bucket/prefix``."""
        return self._backend.uri

    @property
    def endpoint_url(self) -> str | None:
        return self._backend.endpoint_url

    def root_missing(self) -> bool:
        """True when the root is a local directory that does not exist (an object store
        has no directories: an empty prefix is simply empty)."""
        return isinstance(self._backend, _LocalBackend) and not os.path.exists(self._backend.root)

    @property
    def fs(self) -> Any:
        """The fsspec filesystem (created on first use)."""
        if self._fs is None:
            with self._fs_lock:
                if self._fs is None:
                    self._fs = self._backend.make_fs()
        return self._fs

    @staticmethod
    def step_name(step: int) -> str:
        return f"step_{step:08d}"

    def step_uri(self, step: int) -> str:
        """Full URI of a step's directory, for messages and logs."""
        return f"{self._backend.scheme}://{self._step_path(step)}"

    def _step_path(self, step: int) -> str:
        return f"{self._backend.root}/{self.step_name(step)}"

    def _manifest_path(self, step: int) -> str:
        return f"{self._step_path(step)}/{MANIFEST_NAME}"

    def _file_path(self, step: int, relpath: str) -> str:
        """Where a file a manifest or index names lies, never outside the step (on a local
        root, not through a symlink either): CorruptCheckpointError naming it otherwise."""
        try:
            return join_under(
                self._step_path(step), relpath, local=isinstance(self._backend, _LocalBackend)
            )
        except UnsafePathError as e:
            raise CorruptCheckpointError(
                step, str(relpath), f"leaves the step directory ({e.why})", uri=self.uri
            ) from None

    @contextlib.contextmanager
    def _io(self, action: str, passthrough: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
        """Turn a storage failure into a StorageError that says what failed and how to fix it."""
        try:
            yield
        except (StorageError, CorruptCheckpointError):
            raise
        except passthrough:
            raise
        except self._backend.storage_errors() as e:
            raise StorageError(f"{action} at {self.uri} failed: {self._backend.explain(e)}") from e

    # --- writing ----------------------------------------------------------------------

    def upload_file(self, local_path: str | os.PathLike[str], step: int, relpath: str) -> FileEntry:
        """Upload one local file to ``<root>/step_xxx/<relpath>``; return its manifest entry.

        The sha256 is computed from the local file, so the manifest describes what
        was meant to be stored and a damaged upload is caught on restore.
        """
        relpath = check_relpath(relpath)
        local = Path(local_path)
        size = local.stat().st_size
        digest = hash_file(local)
        remote = f"{self._step_path(step)}/{relpath}"
        with self._io(f"uploading {local} as {relpath} of step {step}"):
            self._retrying(lambda: self._backend.put_file(self.fs, str(local), remote))
        return FileEntry(path=relpath, size=size, sha256=digest)

    def upload_dir(
        self,
        local_dir: str | os.PathLike[str],
        step: int,
        prefix: str = "",
        max_bytes_per_s: float | None = None,
    ) -> list[FileEntry]:
        """Upload every file under ``local_dir``; entries are sorted by path.

        Each file's relpath is ``prefix`` + its path relative to ``local_dir``
        (a '/' is added after a non-empty prefix that lacks one). With
        ``max_bytes_per_s``, files go one at a time, paced to that average rate.
        """
        root = Path(local_dir)
        if not root.is_dir():
            raise FileNotFoundError(f"checkpoint staging directory {root} does not exist")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        files = sorted(p for p in root.rglob("*") if p.is_file())
        jobs = [(p, prefix + p.relative_to(root).as_posix()) for p in files]
        if max_bytes_per_s is None:
            return self._parallel([lambda p=p, r=r: self.upload_file(p, step, r) for p, r in jobs])
        out, sent, t0 = [], 0, time.monotonic()
        for p, r in jobs:
            out.append(self.upload_file(p, step, r))
            sent += out[-1].size
            time.sleep(max(0.0, sent / max_bytes_per_s - (time.monotonic() - t0)))
        return sorted(out, key=lambda e: e.path)

    def commit(self, manifest: Manifest) -> None:
        """Make a step visible to readers by writing its manifest, after checking its files.

        Refuses (CorruptCheckpointError) if a listed file is absent or has another
        size in storage: committing it would publish a checkpoint that cannot load.
        """
        step = manifest.step
        step_path = self._step_path(step)
        with self._io(f"listing step {step} before commit"):
            try:
                found = self.fs.find(step_path, detail=True)
            except FileNotFoundError:
                found = {}
        sizes = {posixpath.relpath(k, step_path): v.get("size") for k, v in found.items()}
        for entry in manifest.files:
            have = sizes.get(entry.path)
            if have is None:
                reason = "not in storage; upload it before committing"
            elif have != entry.size:
                reason = f"is {have} bytes in storage, manifest says {entry.size}"
            else:
                continue
            raise CorruptCheckpointError(
                step,
                entry.path,
                reason,
                uri=self.uri,
                message=f"refusing to commit checkpoint step {step} at {self.uri}: "
                f"{entry.path} {reason}",
            )
        with self._io(f"writing the manifest of step {step}"):
            self._backend.write_atomic(
                self.fs, self._manifest_path(step), manifest.to_json(self.signing_key()).encode()
            )

    def write_receipt(self, receipt: Receipt) -> None:
        """Record that a rank of group `receipt.attempt` finished uploading its files of
        `receipt.step` (signed when checkpoint.signing_key_env is set).

        Receipts let a restarted controller commit a step whose uploads all finished
        but whose completion reports were lost with the workers that sent them. They
        live under the attempt that wrote them, so two groups' receipts never mix.
        """
        step, rank = receipt.step, receipt.rank
        body = receipt.to_json(self.signing_key()).encode()
        path = f"{self._step_path(step)}/{RECEIPTS_DIR}/{receipt.attempt}/rank_{rank:05d}.json"
        with self._io(f"writing the upload receipt of rank {rank}, step {step}"):
            self._retrying(lambda: self._backend.write_atomic(self.fs, path, body))

    def write_artifact(self, relpath: str, data: bytes) -> str:
        """Write a job artifact (trace, backfill output, ledger) beside the steps; its URI.

        Artifacts live under ``<root>/artifacts/``, outside every step directory, so
        retention never deletes them and a restore never downloads them.
        """
        path = f"{self._backend.root}/{ARTIFACTS_DIR}/{check_relpath(relpath)}"
        with self._io(f"writing artifact {relpath}"):
            self._backend.write_atomic(self.fs, path, data)
        return f"{self._backend.scheme}://{path}"

    def read_artifact(self, relpath: str) -> bytes | None:
        """An artifact written by `write_artifact`, or None if there is none."""
        path = f"{self._backend.root}/{ARTIFACTS_DIR}/{check_relpath(relpath)}"
        with self._io(f"reading artifact {relpath}", passthrough=(FileNotFoundError,)):
            try:
                return self.fs.cat_file(path)
            except FileNotFoundError:
                return None

    def read_receipts(self, step: int) -> ReceiptScan:
        """Upload receipts of a step, by the attempt (group) that wrote them. A receipt
        that does not parse, is not signed with the key (when one is set) or names
        another step is refused: it can never complete a commit."""
        base = f"{self._step_path(step)}/{RECEIPTS_DIR}"
        key = self.signing_key()
        scan = ReceiptScan()
        with self._io(f"reading upload receipts of step {step}"):
            try:
                found = sorted(self.fs.find(base))
            except FileNotFoundError:
                return scan
            for name in found:
                rel = posixpath.relpath(str(name), self._step_path(step))
                parts = rel.split("/")
                if len(parts) < 3 or not rel.endswith(".json"):
                    continue
                scan.attempts.add(parts[1])
                try:
                    receipt = Receipt.from_json(self.fs.cat_file(name), key)
                except FileNotFoundError:
                    continue
                except ManifestError as e:
                    scan.refused.append((rel, str(e)))
                    continue
                if receipt.step != step or receipt.attempt != parts[1]:
                    scan.refused.append(
                        (rel, f"it is for step {receipt.step}, group {receipt.attempt!r}")
                    )
                    continue
                scan.receipts.setdefault(receipt.attempt, []).append(receipt)
        return scan

    def read_range(self, step: int, relpath: str, start: int, length: int) -> bytes:
        """`length` bytes at `start` of a file of `step` (a ranged GET on S3)."""
        remote = self._file_path(step, relpath)
        with self._io(f"reading {relpath} of step {step}", passthrough=(FileNotFoundError,)):
            try:
                return self._retrying(
                    lambda: self.fs.cat_file(remote, start=start, end=start + length)
                )
            except FileNotFoundError as e:
                raise CorruptCheckpointError(
                    step, relpath, "missing from storage", uri=self.uri
                ) from e

    def remove(self, step: int, relprefix: str) -> None:
        """Delete everything under `relprefix` of a step (an abandoned attempt's files)."""
        path = f"{self._step_path(step)}/{check_relpath(relprefix)}"
        with (
            self._io(f"deleting {relprefix} of step {step}"),
            contextlib.suppress(FileNotFoundError),
        ):
            self.fs.rm(path, recursive=True)

    def _retrying(self, fn: Callable[[], Any]) -> Any:
        """Run a storage call, retrying what may be transient (a dropped connection, a
        throttle, a 5xx) with exponential backoff and jitter (tenacity)."""
        import tenacity

        transient = self._backend.transient_errors()
        return tenacity.Retrying(
            stop=tenacity.stop_after_attempt(constants.SPOTLINE_STORAGE_RETRIES),
            wait=tenacity.wait_random_exponential(multiplier=0.2, max=5.0),
            retry=tenacity.retry_if_exception(lambda e: isinstance(e, transient)),
            reraise=True,
        )(fn)

    def uncommitted_steps(self) -> list[int]:
        """Step directories with neither a manifest nor a quarantine record, ascending
        (uploads in flight or abandoned)."""
        return [
            s
            for s in self._step_dirs()
            if not self._is_committed(s) and not self.holds_quarantine_record(s)
        ]

    def quarantined_steps(self) -> list[int]:
        """Steps set aside after they failed verification (see `quarantine`), ascending."""
        return [
            s
            for s in self._step_dirs()
            if not self._is_committed(s) and self.holds_quarantine_record(s)
        ]

    def quarantine(self, step: int, path: str, reason: str) -> str:
        """Set aside a committed step that failed verification; the URI of its record.

        The record (which file failed, why, and the manifest as it was) is written
        first, then the manifest goes: from then on no listing offers the step, no
        restore reads it again and retention neither counts nor deletes it, and its
        files stay where they are for inspection. A marker rather than a move: on S3 a
        move is a copy of every file, and a crash halfway would tear the evidence. A
        crash between the two writes leaves a step that is still committed, so the
        next restore verifies it again and finishes the job.
        """
        record_path = f"{self._step_path(step)}/{QUARANTINE_NAME}"
        with self._io(f"quarantining step {step}"):
            try:
                raw = self.fs.cat_file(self._manifest_path(step))
            except FileNotFoundError:
                raw = None
            record = {
                "step": step,
                "file": path,
                "reason": redact(reason),
                "quarantined_at": time.time(),
                "manifest": raw.decode("utf-8", "replace") if raw is not None else None,
            }
            self._backend.write_atomic(self.fs, record_path, json.dumps(record, indent=1).encode())
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self._manifest_path(step))
        return f"{self._backend.scheme}://{record_path}"

    def holds_quarantine_record(self, step: int) -> bool:
        """The step's folder holds a quarantine record: it is quarantined, or was, and a
        later save of the same step committed beside the files kept for inspection."""
        with self._io(f"checking the quarantine record of step {step}"):
            return bool(self.fs.exists(f"{self._step_path(step)}/{QUARANTINE_NAME}"))

    # --- reading ----------------------------------------------------------------------

    def _step_dirs(self) -> list[int]:
        with self._io("listing checkpoint steps"):
            try:
                names = self.fs.ls(self._backend.root, detail=False)
            except FileNotFoundError:
                return []
        steps = []
        for name in names:
            m = _STEP_RE.match(posixpath.basename(str(name).rstrip("/")))
            if m:
                steps.append(int(m.group(1)))
        return sorted(set(steps))

    def _is_committed(self, step: int) -> bool:
        with self._io(f"checking the manifest of step {step}"):
            return bool(self.fs.exists(self._manifest_path(step)))

    def committed_steps(self) -> list[int]:
        """Steps with a manifest, ascending. Step directories without one are ignored."""
        return [s for s in self._step_dirs() if self._is_committed(s)]

    def load_manifest(self, step: int) -> Manifest:
        """Read the manifest of a committed step.

        Raises FileNotFoundError if the step is not committed, CorruptCheckpointError
        if its manifest cannot be parsed.
        """
        path = self._manifest_path(step)
        with self._io(f"reading the manifest of step {step}", passthrough=(FileNotFoundError,)):
            try:
                raw = self.fs.cat_file(path)
            except FileNotFoundError as e:
                raise FileNotFoundError(
                    f"checkpoint step {step} is not committed at {self.uri} (no {MANIFEST_NAME})"
                ) from e
        try:
            manifest = Manifest.from_json(raw, self.signing_key())
        except ManifestError as e:
            raise CorruptCheckpointError(step, MANIFEST_NAME, str(e), uri=self.uri) from e
        if manifest.step != step:
            raise CorruptCheckpointError(
                step,
                MANIFEST_NAME,
                f"it says step {manifest.step} but lies in {self.step_name(step)}",
                uri=self.uri,
            )
        return manifest

    def check_owner(self, spec: Any) -> None:
        """Raise CheckpointMismatchError when this URI holds another job's checkpoints, or
        this job's with a different model/data/train spec (beyond RETUNABLE_FIELDS). Reads
        only; writes nothing.

        The newest manifest that parses decides; with none committed, the stored job
        summary does (a job that failed before its first commit still owns its URI).
        """
        for step in reversed(self.committed_steps()):
            try:
                m = self.load_manifest(step)
            except (CorruptCheckpointError, FileNotFoundError):
                continue
            job = m.extra.get("job")
            if resumable_by(spec, job, m.spec_hash, m.extra.get("spec")):
                return
            raise CheckpointMismatchError(
                self.describe_mismatch(spec, job, m.spec_hash, m.extra.get("spec"), step)
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

    def latest_manifest(self) -> Manifest | None:
        """Manifest of the newest committed step, or None if nothing is committed."""
        steps = self.committed_steps()
        return self.load_manifest(steps[-1]) if steps else None

    def verify_remote(self, manifest: Manifest) -> None:
        """Hash every file of ``manifest`` in storage (streamed); raise CorruptCheckpointError."""
        step = manifest.step
        for entry in manifest.files:
            remote = self._file_path(step, entry.path)
            h = hashlib.sha256()
            size = 0
            with self._io(
                f"verifying {entry.path} of step {step}", passthrough=(FileNotFoundError,)
            ):
                try:
                    with self.fs.open(remote, "rb", block_size=HASH_CHUNK_BYTES) as f:
                        while chunk := f.read(HASH_CHUNK_BYTES):
                            h.update(chunk)
                            size += len(chunk)
                except FileNotFoundError as e:
                    raise CorruptCheckpointError(
                        step, entry.path, "missing from storage", uri=self.uri
                    ) from e
            reason = _describe_mismatch(size, h.hexdigest(), entry)
            if reason:
                raise CorruptCheckpointError(step, entry.path, reason, uri=self.uri)

    # --- housekeeping -----------------------------------------------------------------

    def apply_retention(self, keep_last: int, pinned: Iterable[int] = ()) -> list[int]:
        """Delete all but the newest ``keep_last`` committed steps, and abandoned uploads.
        A quarantined step is not committed: it neither counts nor goes.

        A committed step in ``pinned`` (one a reader still uses) is kept past
        ``keep_last`` until a later call no longer pins it. An uncommitted step older
        than the newest commit is abandoned and deleted; one newer than it may still
        be uploading and is left alone. A committed step loses its manifest before its
        files. Returns the deleted steps.
        """
        if keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be >= 1 (got {keep_last})")
        all_steps = self._step_dirs()
        committed = [s for s in all_steps if self._is_committed(s)]
        if not committed:
            return []
        newest = committed[-1]
        held = set(pinned)
        expired = [s for s in committed[:-keep_last] if s not in held]
        committed_set = set(committed)
        abandoned = [
            s
            for s in all_steps
            if s not in committed_set and s < newest and not self.holds_quarantine_record(s)
        ]
        for step in expired:
            with (
                self._io(f"deleting the manifest of expired step {step}"),
                contextlib.suppress(FileNotFoundError),
            ):
                self.fs.rm_file(self._manifest_path(step))
            self._remove_step_dir(step)
        for step in abandoned:
            self._remove_step_dir(step)
        return sorted(expired + abandoned)

    def _remove_step_dir(self, step: int) -> None:
        with self._io(f"deleting step {step}"), contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._step_path(step), recursive=True)

    def check_credentials(self) -> None:
        """S3: fail now (StorageError) if no credentials can be found. No-op for local paths."""
        self._backend.check_credentials()

    def check_writable(self, timeout_s: float | None = None) -> None:
        """Preflight: write, read back and delete a small probe object under the root.

        Any failure (bad bucket, unreachable endpoint, no credentials, no permission,
        read-only disk, no answer within ``timeout_s``) becomes a StorageError that
        says what happened and how to fix it.
        """
        timeout = constants.SPOTLINE_STORAGE_CHECK_TIMEOUT_S if timeout_s is None else timeout_s
        self.check_credentials()
        fs = self._backend.make_fs(probe_timeout_s=timeout)
        probe = (
            f"{self._backend.root}/.spotline-probe-{socket.gethostname()}-{os.getpid()}-"
            f"{uuid.uuid4().hex[:8]}"
        )
        payload = f"spotline storage probe {time.time()}\n".encode()

        def run() -> None:
            fs.pipe_file(probe, payload)
            back = fs.cat_file(probe)
            fs.rm_file(probe)
            if back != payload:
                raise StorageError(
                    f"{self.fields.uri} {self.uri}: a probe object read back different bytes than "
                    "were written; the storage (or a proxy in front of it) is not reliable"
                )

        try:
            _run_with_deadline(run, timeout)
        except StorageError:
            raise
        except (*self._backend.storage_errors(), TimeoutError) as e:
            raise StorageError(
                f"{self.fields.uri} {self.uri} is not writable: {self._backend.explain(e)}"
            ) from e

    # --- helpers ----------------------------------------------------------------------

    def _parallel(self, tasks: list[Callable[[], Any]]) -> list[Any]:
        """Run tasks on a few threads; results in task order; the first error is raised
        after the tasks already running have finished (none is left writing behind us)."""
        if len(tasks) <= 1:
            return [t() for t in tasks]
        with ThreadPoolExecutor(
            max_workers=min(TRANSFER_THREADS, len(tasks)), thread_name_prefix="spotline-ckpt"
        ) as pool:
            futures = [pool.submit(t) for t in tasks]
            done, pending = wait(futures, return_when=FIRST_EXCEPTION)
            for f in pending:
                f.cancel()
        for f in futures:
            if not f.cancelled() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        return [f.result() for f in futures]


def _describe_mismatch(size: int, digest: str | None, entry: FileEntry) -> str | None:
    if size != entry.size:
        return f"size is {size} bytes, manifest says {entry.size}"
    if digest is not None and digest != entry.sha256:
        return f"sha256 is {digest[:16]}..., manifest says {entry.sha256[:16]}..."
    return None
