"""Storage backends of a checkpoint root, by URI scheme: what a URI means, the fsspec
filesystem that reaches it, how one file is put there durably, and a failure in words.

`Backend` is what every scheme gives; `LocalBackend` serves file:// URIs and plain paths
(s3:// lives in `s3.py`). A backend only knows its own scheme: which steps exist and
what a manifest says belong to the checkpoint root (`checkpoint_root.StepStorage`) and
the checkpoint modules it serves; when a retry is worth it, to `retry`.

Never imports an optional package at import time, and never lets a secret into a
message (every message goes out through StorageError, which redacts it).
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from typing import Any

from spotline.storage.errors import StorageError, StoreFields

SUPPORTED_URI_FORMS = (
    "file:///absolute/path",
    "file://./relative/path (relative to the working directory)",
    "a plain local path such as /data/ckpt or ./ckpt",
    "s3://bucket/prefix",
)
URI_SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
# Files of one step move in parallel; each large S3 object is itself split into
# concurrent parts, so a few threads are enough to fill the link.
TRANSFER_THREADS = 4
# Small objects read at once (every rank's upload receipt, every rank's meta file): one
# request each, so a bounded pool of them keeps a read of thousands to a few round trips'
# time without opening a connection per object.
READ_THREADS = 32


def fsync_path(path: str) -> None:
    """Flush a local file's (or directory's) data and metadata to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def bad_uri(uri: object, why: str, fields: StoreFields) -> StorageError:
    forms = "; ".join(SUPPORTED_URI_FORMS)
    return StorageError(f"{fields.uri} {uri!r} is not usable: {why}. Supported forms: {forms}")


class Backend:
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
        self.uri = ""  # normalized, set by `locate`
        self.root = ""  # path inside the filesystem, no scheme, no trailing '/'
        self.locate(uri, rest, bare)

    def locate(self, uri: str, rest: str, bare: bool) -> None:
        """Check `uri` (`rest`: what follows its scheme; `bare`: a plain path) and the
        settings against this scheme, and set `uri` and `root`; StorageError if unusable."""
        raise NotImplementedError

    def make_fs(self, probe_timeout_s: float | None = None) -> Any:
        raise NotImplementedError

    def put_file(self, fs: Any, local: str, remote: str) -> None:
        """Upload one local file to `remote` (a path inside the filesystem)."""
        fs.put_file(local, remote)

    def write_atomic(self, fs: Any, path: str, data: bytes) -> None:
        raise NotImplementedError

    def storage_errors(self) -> tuple[type[BaseException], ...]:
        return (OSError,)

    def explain(self, exc: BaseException) -> str:
        raise NotImplementedError


class LocalBackend(Backend):
    """file:// and plain paths. Shared by all nodes only if the path is on a shared mount."""

    scheme = "file"

    def locate(self, uri: str, rest: str, bare: bool) -> None:
        f, endpoint_url, options = self.fields, self.endpoint_url, self.options
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
            raise bad_uri(uri, "'file://' is followed by no path", f)
        else:
            raise bad_uri(
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
        fsync_path(remote)
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
            fsync_path(directory)
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
