"""The one fsspec layer under data/ and checkpoint/: what a URI is (local or remote),
the options its filesystem takes (checked: s3fs silently ignores a misspelt one), what
a read error means in one line, and the sha256 of a local file read in chunks.

Like the rest of this room it imports nothing else from Spotline; its errors are plain
exceptions (StorageOptionsError) that data/ and checkpoint/ report in their own terms.
"""

from __future__ import annotations

import difflib
import hashlib
import inspect
import os
from pathlib import Path

from spotline.storage.retry import NETWORK_ERRORS

HASH_CHUNK_BYTES = 8 * 2**20
"""Local files are hashed in chunks of this size, never read whole into memory."""


class StorageOptionsError(ValueError):
    """Storage options a filesystem would ignore or choke on; the message names the
    field and the fix."""


# The package an fsspec protocol needs, by URI scheme (for an ImportError's hint).
SCHEME_PACKAGES = {
    "s3": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "hdfs": "pyarrow",
    "http": "aiohttp",
    "https": "aiohttp",
}


def is_remote(uri: str) -> bool:
    """True for an fsspec URI other than file:// (s3://, gs://, http://, memory://...)."""
    return "://" in uri and not uri.startswith("file://")


def local_path(uri: str) -> Path:
    """The local path of a plain path or file:// URI."""
    return Path(uri.removeprefix("file://")).expanduser()


def filesystem_options(
    uri: str,
    *,
    endpoint_url: str | None = None,
    storage_options: dict | None = None,
    options_field: str = "data.storage_options",
) -> dict:
    """Keyword arguments of the fsspec filesystem of `uri`: `storage_options`, plus
    `endpoint_url` for s3:// (unknown S3 options are refused, naming `options_field`:
    StorageOptionsError). A local path or file:// URI takes none: both are ignored
    there, so one set of options can serve a mixture of local and remote sources."""
    if not is_remote(uri):
        return {}
    opts = dict(storage_options or {})
    if uri.split("://", 1)[0].lower() == "s3":
        check_s3_options(opts, options_field)
        if endpoint_url:
            opts["client_kwargs"] = {**opts.get("client_kwargs", {}), "endpoint_url": endpoint_url}
    return opts


# Options every fsspec filesystem takes, besides its own constructor's.
FSSPEC_COMMON_OPTIONS = {
    "skip_instance_cache",
    "use_listings_cache",
    "listings_expiry_time",
    "max_paths",
    "asynchronous",
    "loop",
}
# s3fs options that must be mappings (botocore would fail deep inside with a TypeError).
_S3_MAPPING_OPTIONS = ("client_kwargs", "config_kwargs", "s3_additional_kwargs")


def check_s3_options(options: dict, field: str) -> None:
    """Refuse storage options s3fs would ignore or choke on, naming `field` and the fix.

    s3fs forwards unknown keyword arguments to a base class that keeps them unused, so
    a misspelt `secert:` would silently fall back to other credentials.
    """
    for name in _S3_MAPPING_OPTIONS:
        value = options.get(name)
        if value is not None and not isinstance(value, dict):
            raise StorageOptionsError(
                f"{field}.{name} must be a mapping of keyword arguments (got "
                f"{type(value).__name__}); write it as {name}: {{key: value}}"
            )
    known = _s3fs_option_names()
    if known is None:
        return
    unknown = sorted(str(k) for k in options if k not in known)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(known), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise StorageOptionsError(
            f"{field}: s3fs takes no option {unknown[0]!r}{hint} (it would be ignored). Valid "
            f"options include key, secret, token, profile, anon, client_kwargs, config_kwargs"
        )


def _s3fs_option_names() -> set[str] | None:
    try:
        import s3fs
    except ImportError:  # reported when the filesystem is built
        return None
    import aiobotocore.session

    # s3fs's own keywords; the rest go to the botocore session it creates (`profile`).
    names: set[str] = set(FSSPEC_COMMON_OPTIONS)
    for fn in (s3fs.S3FileSystem.__init__, aiobotocore.session.AioSession.__init__):
        params = inspect.signature(fn).parameters
        names |= {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return names - {"self"}


def explain_read_error(uri: str, e: BaseException) -> str:
    """What went wrong reading `uri` (data, a tokenizer, a model), and the fix, in one
    line."""
    names = {c.__name__ for c in type(e).__mro__}
    if isinstance(e, ImportError):
        scheme = uri.split("://", 1)[0].lower()
        pkg = getattr(e, "name", None) or SCHEME_PACKAGES.get(scheme)
        if pkg is None:
            return f"reading {uri} needs a package that is not installed ({e})"
        pkg = pkg.split(".")[0]
        return (
            f"reading {uri} needs the package {pkg!r}, which is not installed; run: "
            f"pip install {pkg}"
        )
    if "NoCredentialsError" in names:
        return (
            f"no AWS credentials found for {uri}: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE or an instance role, or put key/secret in data.storage_options"
        )
    if isinstance(e, PermissionError) or "AccessDenied" in str(e):
        return f"access denied reading {uri} ({e}); check the credentials' read permission"
    if names & NETWORK_ERRORS:
        return (
            f"cannot reach the server of {uri} ({type(e).__name__}: {e}); check that it is "
            "running and reachable from this node (and data.endpoint_url for S3)"
        )
    return f"cannot read {uri}: {type(e).__name__}: {' '.join(str(e).split())}"


def unreachable(uri: str) -> str | None:
    """For http(s): why the server cannot be reached, when that is why a path 'does not
    exist' (fsspec's HTTP filesystem reports a refused connection as a missing file)."""
    import socket
    import urllib.parse

    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=5).close()
    except OSError as e:
        return (
            f"cannot reach the server of {uri} ({parts.hostname}:{port}: "
            f"{e.strerror or e}); check that it is running and reachable from this node"
        )
    return None


def hash_file(path: str | os.PathLike[str]) -> str:
    """sha256 hex digest of a local file, read in 8 MiB chunks (never all in memory)."""
    h = hashlib.sha256()
    buf = bytearray(HASH_CHUNK_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()
