"""Where `prepare` writes: the output directory (temp-and-rename locally, whole objects
remotely, every file hashed as it is written), the plan record and the per-shard resume
records, the claim on an output (refuse, resume or overwrite) and the shard writer.

It must never read or tokenize the input, nor remove anything at `--out` that is not
part of a prepared dataset.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from spotline.data.errors import DataError
from spotline.data.prepare_inputs import filesystem
from spotline.data.tokens import INDEX_NAME, PARTS_DIR, READ_CHUNK, join_uri
from spotline.storage import UnsafePathError, files_under, join_under, some_names
from spotline.storage.fs import is_remote

SHARD_RE = re.compile(r"^shard-(\d+)(\.docs)?\.npy$")


class _HashingWriter:
    def __init__(self, f):
        self.f = f
        self.h = hashlib.sha256()
        self.n = 0

    def write(self, data) -> int:
        data = bytes(data)
        self.h.update(data)
        self.n += len(data)
        return self.f.write(data)


class Output:
    """The output directory through fsspec; local files are written under a temp name
    and renamed, remote objects appear whole when their upload completes."""

    def __init__(self, uri: str, endpoint_url, storage_options):
        self.uri = uri
        self.fs, self.root = filesystem(uri, endpoint_url, storage_options, "out")
        self.remote = is_remote(uri)

    def path(self, name: str) -> str:
        return join_uri(self.root, name)

    def check_entry(self, name: object, what: str) -> None:
        """Refuse a file name read back from a resume record that leaves the output
        (DataError naming the record: a resume must not read or list it elsewhere)."""
        try:
            join_under(self.root, name, local=not self.remote)
        except UnsafePathError as e:
            raise DataError(
                f"out: {join_uri(self.uri, what)} {name!r} leaves the dataset ({e.why}); "
                f"delete {join_uri(self.uri, PARTS_DIR)} and run prepare again"
            ) from None

    @contextlib.contextmanager
    def open_write(self, name: str):
        final = self.path(name)
        if self.remote:
            with self.fs.open(final, "wb") as f:
                yield f
            return
        tmp = f"{final}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                yield f
            os.replace(tmp, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def write_npy(self, name: str, arr: np.ndarray) -> tuple[int, str]:
        with self.open_write(name) as f:
            w = _HashingWriter(f)
            np.lib.format.write_array(w, np.ascontiguousarray(arr), allow_pickle=False)
        return w.n, w.h.hexdigest()

    def write_json(self, name: str, obj: Any) -> bytes:
        blob = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
        with self.open_write(name) as f:
            f.write(blob)
        return blob

    def read(self, name: str) -> bytes | None:
        try:
            return self.fs.cat_file(self.path(name))
        except FileNotFoundError:
            return None

    def digest(self, name: str) -> tuple[int, str] | None:
        """(bytes, sha256) of a file, or None if it is not there."""
        h = hashlib.sha256()
        n = 0
        try:
            with self.fs.open(self.path(name), "rb") as f:
                while chunk := f.read(READ_CHUNK):
                    h.update(chunk)
                    n += len(chunk)
        except FileNotFoundError:
            return None
        return n, h.hexdigest()

    def listdir(self, name: str = "") -> list[str]:
        try:
            found = self.fs.ls(self.path(name) if name else self.root, detail=False)
        except FileNotFoundError:
            return []
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in found]

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(name))


def _shard_name(k: int) -> str:
    return f"shard-{k:05d}"


def _record_name(k: int) -> str:
    return f"{PARTS_DIR}/{_shard_name(k)}.json"


PLAN_NAME = f"{PARTS_DIR}/plan.json"
# What a plan record holds besides its hash, and how a difference is told to the user.
_PLAN_WHY = {
    "tokenizer_sha256": "another tokenizer",
    "input": "another input",
    "listing_sha256": "other input files",
    "mtimes_sha256": "input files changed since",
    "text_field": "another --field",
    "column": "another --column",
    "shard_tokens": "another shard size",
}


def _is_dataset_file(name: str) -> bool:
    """A file `prepare` writes at the top of its output (or a temp file of one)."""
    return name == INDEX_NAME or name.startswith((f"{PARTS_DIR}/", "shard-"))


def claim(out: Output, record: dict, overwrite: bool) -> tuple[list[dict], tuple[int, int]]:
    """Make `out` this run's: (recorded shards to keep, where to start). Refuses (unless
    `overwrite`) anything already there but an unfinished run of the same plan;
    `overwrite` removes the old dataset's files, its index first."""
    found = files_under(out.fs, out.root)
    if found == [""]:
        raise DataError(f"--out {out.uri} is a file; give a directory for the dataset")
    raw = out.read(PLAN_NAME) if found else None
    try:
        plan = json.loads(raw) if raw is not None else None
    except ValueError:
        plan = None
    plan = plan if isinstance(plan, dict) else None
    finished = INDEX_NAME in found
    if not finished and plan is not None and plan.get("plan_sha256") == record["plan_sha256"]:
        return _resume_point(out)
    if found and not overwrite:
        fix = "pass --overwrite to replace it, or choose another --out"
        if finished:
            raise DataError(f"--out {out.uri} holds a finished dataset ({_about(out)}); {fix}")
        if plan is not None:
            why = [w for k, w in _PLAN_WHY.items() if plan.get(k, record[k]) != record[k]]
            raise DataError(
                f"--out {out.uri} holds an unfinished dataset of "
                f"{', '.join(why) if why else 'other inputs or settings'} (finish it with "
                f"the input and tokenizer it was started with); {fix}"
            )
        raise DataError(
            f"--out {out.uri} is not empty and not a prepared dataset (it holds "
            f"{some_names(found)}); choose an empty or new --out, or pass --overwrite to "
            "write the dataset beside those files"
        )
    if INDEX_NAME in found:  # first: from here on the old dataset is no longer whole
        out.remove(INDEX_NAME)
    for name in found:
        if _is_dataset_file(name):
            out.remove(name)
    if not out.remote:
        Path(out.root, PARTS_DIR).mkdir(parents=True, exist_ok=True)
    return [], (0, 0)


def _about(out: Output) -> str:
    """A few words on the finished dataset at `out`, from its index."""
    try:
        index = json.loads(out.read(INDEX_NAME) or b"{}")
        return (
            f"{int(index['total_tokens']):,} tokens, tokenizer "
            f"{str(index['tokenizer_sha256'])[:12]}, from {index['inputs'][0]['uri']}"
        )
    except (ValueError, KeyError, TypeError, IndexError):
        return INDEX_NAME


def _resume_point(out: Output) -> tuple[list[dict], tuple[int, int]]:
    """The recorded shards of the same plan that are still intact (a prefix), and where
    the next starts: (part, tokens of that part already in shards)."""
    done: list[dict] = []
    while True:
        raw = out.read(_record_name(len(done)))
        if raw is None:
            break
        try:
            rec = json.loads(raw)
            e = rec["entry"]
            for key in ("path", "docs_path"):
                out.check_entry(e[key], f"{_record_name(len(done))} {key}")
            ok = out.digest(e["path"]) == (e["bytes"], e["sha256"]) and out.digest(
                e["docs_path"]
            ) == (e["docs_bytes"], e["docs_sha256"])
        except DataError:
            raise
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            break
        done.append(rec)
    return done, (tuple(done[-1]["end"]) if done else (0, 0))


class ShardWriter:
    """Cuts the concatenated parts into shards of exactly `shard_tokens` (the last one
    shorter), writing each with its document starts and a resume record."""

    def __init__(
        self, out: Output, shard_tokens: int, dtype, start: tuple[int, int], first_shard: int
    ):
        self.out = out
        self.shard_tokens = shard_tokens
        self.dtype = dtype
        self.start = start
        self.k = first_shard
        self.buf: list[np.ndarray] = []
        self.docs: list[np.ndarray] = []
        self.n = 0

    def add(self, p: int, toks: np.ndarray, lens: np.ndarray, skip: int) -> list[dict]:
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]]) if lens.size else lens
        written = []
        i = skip
        while i < toks.size:
            take = min(self.shard_tokens - self.n, toks.size - i)
            inside = starts[(starts >= i) & (starts < i + take)]
            self.docs.append(inside - i + self.n)
            self.buf.append(toks[i : i + take])
            self.n += take
            i += take
            if self.n == self.shard_tokens:
                end = (p + 1, 0) if i == toks.size else (p, i)
                written.append(self._emit(end))
        return written

    def finish(self, n_parts: int) -> list[dict]:
        return [self._emit((n_parts, 0))] if self.n else []

    def _emit(self, end: tuple[int, int]) -> dict:
        name = _shard_name(self.k)
        tokens = np.concatenate(self.buf).astype(self.dtype, copy=False)
        docs = np.concatenate(self.docs).astype(np.int64) if self.docs else np.zeros(0, np.int64)
        nbytes, sha = self.out.write_npy(f"{name}.npy", tokens)
        dbytes, dsha = self.out.write_npy(f"{name}.docs.npy", docs)
        entry = {
            "path": f"{name}.npy",
            "tokens": int(tokens.size),
            "documents": int(docs.size),
            "bytes": nbytes,
            "sha256": sha,
            "docs_path": f"{name}.docs.npy",
            "docs_bytes": dbytes,
            "docs_sha256": dsha,
        }
        record = {"shard": self.k, "entry": entry, "start": list(self.start), "end": list(end)}
        self.out.write_json(_record_name(self.k), record)
        self.k += 1
        self.start = end
        self.buf, self.docs, self.n = [], [], 0
        return entry
