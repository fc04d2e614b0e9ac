"""Reads the training corpus into one byte array, split into train and held-out.

The default corpus is the source of Python's own standard library, so a job
runs with no download. A directory, file or fsspec URI of text works too.
Reading is deterministic: files in sorted order, truncated at max_bytes.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spotline.config.redact import redact
from spotline.config.schema import DataSpec


class CorpusError(ValueError):
    """The corpus cannot be read. The message names data.corpus and the fix."""


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # uint8 tokens
    heldout: np.ndarray
    source: str

    @property
    def total_bytes(self) -> int:
        return int(self.train.size + self.heldout.size)


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def _local_files(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    if root.is_file():
        return [root]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        # site-packages holds third-party code; keep the stdlib corpus the same everywhere.
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        out.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(suffixes))
    return out


def _read_local(root: Path, spec: DataSpec) -> bytes:
    if not root.exists():
        raise CorpusError(
            f"data.corpus: {root} does not exist; point it at a directory or file of text, "
            "or use 'stdlib'"
        )
    try:
        files = _local_files(root, tuple(spec.file_suffixes))
    except OSError as e:
        raise CorpusError(f"data.corpus: cannot list {root}: {e}") from None
    return _concat(files, spec.max_bytes, root, lambda p: p.read_bytes())


# The package an fsspec protocol needs, by URI scheme (for an ImportError's hint).
_SCHEME_PACKAGES = {
    "s3": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "hdfs": "pyarrow",
    "http": "aiohttp",
    "https": "aiohttp",
}


def fsspec_options(uri: str, spec: DataSpec) -> dict:
    """Keyword arguments of the corpus's fsspec filesystem: data.storage_options, plus
    data.endpoint_url for s3://; unknown S3 options are refused."""
    opts = dict(spec.storage_options)
    scheme = uri.split("://", 1)[0].lower()
    if scheme == "s3":
        from spotline.checkpoint.store import check_s3_options

        try:
            check_s3_options(opts, "data.storage_options")
        except Exception as e:  # noqa: BLE001 - StorageError: report it as a corpus error
            raise CorpusError(str(e)) from None
        if spec.endpoint_url:
            opts["client_kwargs"] = {
                **opts.get("client_kwargs", {}),
                "endpoint_url": spec.endpoint_url,
            }
    elif spec.endpoint_url:
        raise CorpusError(
            f"data.endpoint_url is set but data.corpus {uri!r} is not s3://; remove it"
        )
    return opts


def explain_read_error(uri: str, e: BaseException) -> str:
    """What went wrong reading the corpus, and the fix, in one line."""
    names = {c.__name__ for c in type(e).__mro__}
    if isinstance(e, ImportError):
        scheme = uri.split("://", 1)[0].lower()
        pkg = getattr(e, "name", None) or _SCHEME_PACKAGES.get(scheme)
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
    if any(
        n in names
        for n in (
            "ClientConnectorError",
            "ConnectionError",
            "EndpointConnectionError",
            "ServerDisconnectedError",
            "TimeoutError",
            "ClientOSError",
        )
    ):
        return (
            f"cannot reach the server of {uri} ({type(e).__name__}: {e}); check that it is "
            "running and reachable from this node (and data.endpoint_url for S3)"
        )
    return f"cannot read {uri}: {type(e).__name__}: {e}"


def _unreachable(uri: str) -> str | None:
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


def _read_fsspec(uri: str, spec: DataSpec) -> bytes:
    import fsspec

    opts = fsspec_options(uri, spec)
    try:
        fs, path = fsspec.core.url_to_fs(uri, **opts)
        if fs.isfile(path):
            files = [path]
        else:
            files = sorted(p for p in fs.find(path) if p.endswith(tuple(spec.file_suffixes)))
        if not files:
            fs.info(path)  # an empty listing may hide an unreachable server: ask directly
    except FileNotFoundError:
        down = _unreachable(uri)
        if down:
            raise CorpusError(f"data.corpus: {down}") from None
        raise CorpusError(f"data.corpus: {uri} does not exist; check the URI") from None
    except Exception as e:  # noqa: BLE001 - any backend error means unreadable
        raise CorpusError(f"data.corpus: {redact(explain_read_error(uri, e))}") from None
    return _concat(files, spec.max_bytes, uri, fs.cat_file)


def _concat(files, max_bytes: int, where, read) -> bytes:
    chunks: list[bytes] = []
    total = 0
    errors = 0
    first_error: BaseException | None = None
    for f in files:
        try:
            data = read(f)
        except Exception as e:  # noqa: BLE001 - counted, and the first one reported
            errors += 1
            first_error = first_error or e
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        if first_error is not None:
            raise CorpusError(
                f"data.corpus: none of the {errors} text files in {where} could be read; the "
                f"first: {redact(explain_read_error(str(where), first_error))}"
            )
        raise CorpusError(
            f"data.corpus: no text files found in {where}; check the path and data.file_suffixes"
        )
    return b"\n".join(chunks)[:max_bytes]


def load_corpus(spec: DataSpec, min_tokens: int = 0) -> Corpus:
    """Read and split the corpus. `min_tokens` is the smallest usable split size."""
    src = spec.corpus
    if src == "stdlib":
        raw = _read_local(Path(stdlib_root()), spec)
    elif "://" in src and not src.startswith("file://"):
        raw = _read_fsspec(src, spec)
    else:
        raw = _read_local(Path(src.removeprefix("file://")).expanduser(), spec)
    arr = np.frombuffer(raw, dtype=np.uint8)
    split = int(arr.size * (1.0 - spec.heldout_fraction))
    corpus = Corpus(train=arr[:split], heldout=arr[split:], source=src)
    small = min(corpus.train.size, corpus.heldout.size)
    if small < min_tokens:
        raise CorpusError(
            f"data.corpus: {src} has {arr.size} bytes, too few for sequences of {min_tokens - 1} "
            f"tokens in both the train and held-out splits; add text, raise data.max_bytes or "
            "lower model.seq_len"
        )
    return corpus
