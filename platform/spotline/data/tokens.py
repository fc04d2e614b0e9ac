"""data.kind 'tokens': prepared datasets, memory-mapped from a node-local cache.

On disk (what `spotline prepare` writes, see `spotline.data.prepare`):

    <uri>/index.json              written last: no index, no dataset
    <uri>/shard-00000.npy         1-D uint16 (vocab <= 65536) or uint32 token ids
    <uri>/shard-00000.docs.npy    1-D int64: offsets in the shard where documents start
    ...
    <uri>/_parts/                 resume records of `prepare` (not read here)

Every document's tokens are followed by the tokenizer's end-of-text token (b"\\n"
for the byte tokenizer). The shards are plain .npy files: `np.load(path,
mmap_mode="r")` reads them anywhere.

A worker reads index.json, then memory-maps each shard the first time one of its
windows touches it: a local dataset in place (its sha256 checked once per node),
a remote one from `data.cache_dir`, downloaded once per node (under a file lock,
so the ranks of a node never download twice) to a temp name, checked against the
index's size and sha256, and renamed into place. A shard that is missing,
truncated or corrupt raises `ShardError`, naming it.

An index is read as untrusted: a shard path that is absolute, holds '..', names
another location or (in a local dataset) is a symlink that resolves outside it is
refused, naming the entry (`spotline.storage.join_under`). No file outside the
dataset is ever opened.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from spotline import constants
from spotline.config.redact import redact
from spotline.data.errors import DataError, ShardError, storage_kwargs
from spotline.data.streams import Mixture, ShardedStream, split_point
from spotline.storage import UnsafePathError, check_relpath, join_under
from spotline.storage.fs import explain_read_error, hash_file, is_remote, local_path
from spotline.storage.retry import network_cause, retrying

if TYPE_CHECKING:
    from spotline.config.schema import JobSpec
    from spotline.data.tokenizer import Tokenizer

FORMAT = "spotline-tokens"
VERSION = 1
INDEX_NAME = "index.json"
PARTS_DIR = "_parts"
READ_CHUNK = 8 << 20
_INDEX_KEYS = ("dtype", "vocab_size", "total_tokens", "documents", "shards")
_SHARD_KEYS = ("path", "tokens", "bytes", "sha256")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def join_uri(root: str, name: str) -> str:
    return root.rstrip("/") + "/" + name


def _fs(uri: str, endpoint_url: str | None, storage_options: dict | None, field: str):
    """(filesystem, path) of `uri`; DataError naming `field` if no filesystem fits."""
    import fsspec

    opts = storage_kwargs(uri, endpoint_url=endpoint_url, storage_options=storage_options)
    try:
        if is_remote(uri):
            return fsspec.core.url_to_fs(uri, **opts)
        return fsspec.filesystem("file"), str(local_path(uri).resolve())
    except Exception as e:  # noqa: BLE001 - ImportError, bad URI: one line
        raise DataError(f"{field}: {redact(explain_read_error(uri, e))}") from None


def read_index(
    uri: str,
    *,
    endpoint_url: str | None = None,
    storage_options: dict | None = None,
    field: str = "data.uri",
) -> tuple[dict, str]:
    """The dataset's index.json and the sha256 of its bytes (the dataset's identity).
    Reads only the index. DataError naming `field` when there is none or it is not a
    Spotline index."""
    fs, root = _fs(uri, endpoint_url, storage_options, field)
    path = join_uri(root, INDEX_NAME)
    try:
        raw = fs.cat_file(path)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise DataError(
            f"{field}: no {INDEX_NAME} at {uri}: run `spotline prepare` first (an "
            "interrupted prepare writes no index: run it again to finish)"
        ) from None
    except Exception as e:  # noqa: BLE001 - any backend error means unreadable
        raise DataError(
            f"{field}: {redact(explain_read_error(join_uri(uri, INDEX_NAME), e))}"
        ) from None
    index = parse_index(raw, uri, field)
    if not is_remote(uri):
        for i, shard in enumerate(index["shards"]):
            _shard_path(shard, i, join_uri(uri, INDEX_NAME), field, root=root, local=True)
    return index, hashlib.sha256(raw).hexdigest()


def parse_index(raw: bytes, uri: str, field: str = "data.uri") -> dict:
    """The index in `raw`, checked; DataError naming `field` if it is not one."""
    where = join_uri(uri, INDEX_NAME)
    try:
        index = json.loads(raw)
    except ValueError:
        index = None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise DataError(
            f'{field}: {where} is not a Spotline token index (no "format": "{FORMAT}"); '
            "point it at a directory `spotline prepare` wrote"
        )
    if index.get("version") != VERSION:
        raise DataError(
            f"{field}: {where} is version {index.get('version')!r} of the token format; this "
            f"Spotline reads version {VERSION}: prepare the dataset again"
        )
    missing = [k for k in _INDEX_KEYS if k not in index]
    bad_shard = any(
        not isinstance(s, dict) or any(k not in s for k in _SHARD_KEYS)
        for s in index.get("shards", [])
    ) or not isinstance(index.get("shards"), list)
    if missing or bad_shard or index["dtype"] not in ("uint16", "uint32"):
        what = f"lacks {', '.join(missing)}" if missing else "has malformed shard entries"
        if not missing and not bad_shard:
            what = f"has dtype {index['dtype']!r} (want uint16 or uint32)"
        raise DataError(f"{field}: {where} {what}; prepare the dataset again")
    for i, shard in enumerate(index["shards"]):
        _check_shard(shard, i, where, field)
    return index


def _check_shard(shard: dict, i: int, where: str, field: str) -> None:
    """One shard entry of an index: its paths stay inside the dataset, and its sha256
    (the shard's file name in the node-local cache) is a sha256."""
    for key in ("path", "docs_path"):
        if key == "path" or key in shard:
            _shard_path(shard, i, where, field, key=key)
    if not isinstance(shard["sha256"], str) or not _SHA256_RE.match(shard["sha256"]):
        raise DataError(
            f"{field}: {where} shard {i} sha256 {shard['sha256']!r} is not 64 lower-case hex "
            "digits; prepare the dataset again"
        )
    for key in ("tokens", "bytes"):
        n = shard[key]
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise DataError(
                f"{field}: {where} shard {i} {key} {n!r} is not a count; prepare the dataset again"
            )


def _shard_path(
    shard: dict,
    i: int,
    where: str,
    field: str,
    *,
    key: str = "path",
    root: str | None = None,
    local: bool = False,
    error: type[DataError] = DataError,
) -> str:
    """`shard[key]`, checked, and joined under `root` when given (`local`: its real
    path, which must lie inside the dataset too); `error` naming the entry otherwise."""
    try:
        if root is None:
            return check_relpath(shard[key])
        return join_under(root, shard[key], local=local)
    except UnsafePathError as e:
        raise error(
            f"{field}: {where} shard {i} {key} {shard[key]!r} leaves the dataset "
            f"({e.why}); prepare the dataset again"
        ) from None


# --- the node-local shard cache -------------------------------------------------------


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock between the processes of a node (flock on a lock file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


class ShardCache:
    """Shards by sha256 under `cache_dir/shards/`, each downloaded once per node.

    `local(uri, fs, path, entry)` returns a local file holding the shard, verified:
    for a local dataset the file itself (its sha256 checked once per node, recorded
    by size and mtime under `cache_dir/verified/`), for a remote one a copy in the
    cache. `downloads` lists the URIs this process downloaded.
    """

    def __init__(self, cache_dir: str | os.PathLike[str]):
        self.root = Path(cache_dir)
        self.downloads: list[str] = []
        self._lock = threading.Lock()

    def local(self, uri: str, fs, path: str, entry: dict, remote: bool) -> Path:
        sha, size = entry["sha256"], int(entry["bytes"])
        if not remote:
            return self._verify_in_place(uri, Path(path), sha, size)
        target = self.root / "shards" / f"{sha}.npy"
        if self._cached(target, size):
            return target
        self._writable(target.parent)
        with self._lock, _file_lock(target.with_suffix(".lock")):
            if self._cached(target, size):  # another rank of this node fetched it
                return target
            self._download(uri, fs, path, target, sha, size)
        return target

    @staticmethod
    def _cached(target: Path, size: int) -> bool:
        try:
            return target.stat().st_size == size
        except FileNotFoundError:
            return False

    @staticmethod
    def _writable(folder: Path) -> None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DataError(
                f"data.cache_dir: cannot create {folder} ({e.strerror or e}); point "
                "data.cache_dir at a writable node-local directory"
            ) from None

    def _download(self, uri: str, fs, path: str, target: Path, sha: str, size: int) -> None:
        """Copy the shard into the cache, verified; a dropped connection or a throttle is
        retried (`storage.retry.retrying`), a missing or damaged shard never is."""
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.part")

        def fetch() -> tuple[int, str]:
            h = hashlib.sha256()
            n = 0
            with fs.open(path, "rb") as src, open(tmp, "wb") as dst:
                while chunk := src.read(READ_CHUNK):
                    h.update(chunk)
                    try:
                        dst.write(chunk)
                    except OSError as e:
                        raise DataError(
                            f"data.cache_dir: cannot write {tmp.parent} ({e.strerror or e}); "
                            "free space there or point data.cache_dir at a larger disk"
                        ) from None
                    n += len(chunk)
            return n, h.hexdigest()

        try:
            try:
                n, got = retrying(fetch, constants.SPOTLINE_STORAGE_RETRIES)
            except DataError:
                raise
            except Exception as e:  # noqa: BLE001 - any backend error: unreadable
                cause = network_cause(e)
                if isinstance(e, FileNotFoundError) and cause is None:
                    raise ShardError(
                        f"shard {uri} is missing (the index lists it); prepare the dataset again"
                    ) from None
                why = explain_read_error(uri, cause or e)
                raise ShardError(f"shard {redact(why)}") from None
            _check_content(uri, n, got, size, sha)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, target)
        self.downloads.append(uri)

    def _verify_in_place(self, uri: str, path: Path, sha: str, size: int) -> Path:
        try:
            st = path.stat()
        except FileNotFoundError:
            raise ShardError(
                f"shard {uri} is missing (the index lists it); prepare the dataset again"
            ) from None
        if st.st_size != size:
            _check_content(uri, st.st_size, None, size, sha)
        stamp = self.root / "verified" / f"{sha}.json"
        mark = {"path": str(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}

        def stamped() -> bool:
            try:
                return json.loads(stamp.read_text()) == mark
            except (OSError, ValueError):
                return False

        if stamped():
            return path

        with contextlib.ExitStack() as stack:
            stack.enter_context(self._lock)
            try:
                stack.enter_context(_file_lock(stamp.with_suffix(".lock")))
            except OSError:  # a read-only cache: verify in every process
                pass
            else:
                if stamped():  # another rank of this node verified it meanwhile
                    return path
            _check_content(uri, st.st_size, hash_file(path), size, sha)
            with contextlib.suppress(OSError):
                tmp = stamp.with_name(f".{stamp.name}.{os.getpid()}")
                tmp.write_text(json.dumps(mark))
                os.replace(tmp, stamp)
        return path


def _check_content(uri: str, n: int, got: str | None, size: int, sha: str) -> None:
    if n != size:
        how = "truncated" if n < size else "longer than the index says"
        raise ShardError(
            f"shard {uri} is {how}: {n} bytes, the index says {size}; prepare the dataset "
            "again (or restore the shard)"
        )
    if got is not None and got != sha:
        raise ShardError(
            f"shard {uri} is corrupt: its sha256 is {got[:12]}..., the index says "
            f"{sha[:12]}...; prepare the dataset again (or restore the shard)"
        )


# --- datasets --------------------------------------------------------------------------


class TokenSource:
    """One prepared dataset: its index, and its tokens as a stream of memory-mapped shards."""

    def __init__(
        self,
        uri: str,
        cache: ShardCache,
        *,
        endpoint_url: str | None = None,
        storage_options: dict | None = None,
        field: str = "data.uri",
        weight: float = 1.0,
    ):
        self.uri = uri
        self.field = field
        self.weight = weight
        self.index, self.index_sha256 = read_index(
            uri, endpoint_url=endpoint_url, storage_options=storage_options, field=field
        )
        self.fs, self.root = _fs(uri, endpoint_url, storage_options, field)
        self.remote = is_remote(uri)
        self.cache = cache
        self.dtype = np.dtype(self.index["dtype"])
        self.shards = self.index["shards"]
        self.stream = ShardedStream([int(s["tokens"]) for s in self.shards], self._open, name=uri)
        if self.stream.size != int(self.index["total_tokens"]):
            raise DataError(
                f"{field}: {join_uri(uri, INDEX_NAME)} says {self.index['total_tokens']} "
                f"tokens but its shards hold {self.stream.size}; prepare the dataset again"
            )

    def shard_uri(self, i: int) -> str:
        return join_uri(self.uri, self.shards[i]["path"])

    def _open(self, i: int) -> np.ndarray:
        entry = self.shards[i]
        uri = self.shard_uri(i)
        where = join_uri(self.uri, INDEX_NAME)
        # Checked when the index was read, and again here: a link may have been planted
        # in a local dataset since.
        path = _shard_path(
            entry, i, where, self.field, root=self.root, local=not self.remote, error=ShardError
        )
        local = self.cache.local(uri, self.fs, path, entry, self.remote)
        try:
            arr = np.load(local, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise ShardError(
                f"shard {uri} is not a .npy array ({e}); prepare the dataset again"
            ) from None
        if arr.ndim != 1 or arr.dtype != self.dtype or arr.size != int(entry["tokens"]):
            raise ShardError(
                f"shard {uri} holds {arr.dtype}{list(arr.shape)}, the index says "
                f"{self.dtype}[{entry['tokens']}]; prepare the dataset again"
            )
        return arr


class TokenDataset:
    """data.kind 'tokens': the job's prepared datasets (data.uri, or the weighted
    data.sources), each split by position: the last data.heldout_fraction of its tokens
    are held out. `.train` and `.heldout` are streams (a `Mixture` when there are several
    sources) that a `Sampler` draws from. Shards are read on demand through the node-local
    cache at data.cache_dir.

    The index's tokenizer must be the job's (tokenizer.sha256, or the `tokenizer`
    given) and its vocabulary must fit the model's.
    """

    kind = "tokens"

    def __init__(
        self,
        spec: JobSpec,
        tokenizer: Tokenizer | None = None,
        *,
        min_tokens: int | None = None,
    ):
        d = spec.data
        self.cache = ShardCache(d.cache_dir)
        sources = d.token_sources()
        need = spec.model.seq_len + 2 if min_tokens is None else min_tokens
        mine = _job_tokenizer_sha(spec, tokenizer)
        self.sources: list[TokenSource] = []
        for i, src in enumerate(sources):
            # One source is data.uri (the spec stores it as data.sources[0]).
            field = "data.uri" if len(sources) == 1 else f"data.sources[{i}].uri"
            s = TokenSource(
                src.uri,
                self.cache,
                endpoint_url=d.endpoint_url,
                storage_options=d.storage_options,
                field=field,
                weight=src.weight,
            )
            if src.index_sha256 is not None and src.index_sha256 != s.index_sha256:
                where = field if len(sources) == 1 else f"data.sources[{i}].index_sha256"
                raise DataError(
                    f"{where}: the index at {src.uri} hashes to {s.index_sha256[:12]}..., not "
                    f"{src.index_sha256[:12]}...: the dataset changed since the job was "
                    "planned; drop index_sha256 to take it as it is now"
                )
            theirs = s.index.get("tokenizer_sha256")
            if theirs is not None and mine is not None and theirs != mine:
                raise DataError(
                    f"{field}: {src.uri} was prepared with tokenizer {str(theirs)[:12]}... but "
                    f"tokenizer.sha256 is {mine[:12]}... ({spec.tokenizer.path or spec.tokenizer.kind}); "
                    "prepare it again with this tokenizer, or point tokenizer.path at the one "
                    "it used"
                )
            vocab = _model_vocab(spec)
            if vocab is not None and int(s.index["vocab_size"]) > vocab:
                raise DataError(
                    f"{field}: {src.uri} was prepared with a vocabulary of "
                    f"{s.index['vocab_size']}, more than the model's ({vocab}); raise "
                    "model.vocab_size or use the tokenizer it was prepared with"
                )
            split = split_point(s.stream.size, d.heldout_fraction)
            s.train = s.stream.view(0, split, f"{src.uri} (train)")
            s.heldout = s.stream.view(split, s.stream.size, f"{src.uri} (held-out)")
            if min(split, s.stream.size - split) < need:
                raise DataError(
                    f"{field}: {src.uri} has {s.stream.size} tokens, too few for sequences of "
                    f"{need - 1} tokens in both its train and held-out splits (held-out "
                    f"fraction {d.heldout_fraction}); prepare more text, or lower "
                    "model.seq_len or data.heldout_fraction"
                )
            self.sources.append(s)
        shas = {s.index.get("tokenizer_sha256") for s in self.sources}
        if len(shas) > 1:
            raise DataError(
                "data.sources: the datasets were prepared with different tokenizers "
                f"({', '.join(sorted(str(x)[:12] for x in shas))}); prepare them all with the "
                "job's tokenizer"
            )
        if len(self.sources) == 1:
            self.train = self.sources[0].train
            self.heldout = self.sources[0].heldout
        else:
            self.train = Mixture([(s.train, s.weight) for s in self.sources])
            self.heldout = Mixture([(s.heldout, s.weight) for s in self.sources])
        first = self.sources[0].index
        self.vocab_size = max(int(s.index["vocab_size"]) for s in self.sources)
        self.tokenizer_sha256 = first.get("tokenizer_sha256")
        self.eos_id = first.get("eos_id")

    @property
    def index_sha256s(self) -> list[str]:
        return [s.index_sha256 for s in self.sources]

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "tokens",
            "sources": [
                {
                    "uri": s.uri,
                    "weight": s.weight,
                    "index_sha256": s.index_sha256,
                    "tokens": s.stream.size,
                    "shards": len(s.shards),
                }
                for s in self.sources
            ],
            "train_tokens": self.train.size,
            "heldout_tokens": self.heldout.size,
            "tokenizer_sha256": self.tokenizer_sha256,
        }


def _job_tokenizer_sha(spec: JobSpec, tokenizer: Tokenizer | None) -> str | None:
    if tokenizer is not None:
        return tokenizer.sha256
    t = spec.tokenizer
    return t.sha256 or ("byte" if t.kind == "byte" else None)


def _model_vocab(spec: JobSpec) -> int | None:
    try:
        return spec.vocab_size()
    except ValueError:
        return None
