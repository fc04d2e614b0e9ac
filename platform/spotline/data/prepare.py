"""`spotline prepare`: tokenize raw text into a sharded token dataset (see
`spotline.data.tokens` for the format).

Input, by suffix: text files (.txt .md .py .rst: one document per file), JSON lines
(.jsonl .json: one document per line, from `text_field`) and Parquet (.parquet: the
`column`, default `text_field`; needs pyarrow). The input may be a file, a
directory (recursively), a glob, 'stdlib', or any fsspec URI of those.

The work is cut into parts, fixed by the input alone (groups of text files, byte
ranges of a JSONL file, row groups of a Parquet file), tokenized by a process
pool and concatenated in input order, so the shards and the index are
byte-identical whatever the number of workers. Every finished shard is recorded
under out/_parts/ with its sha256; a rerun verifies the recorded shards, skips
them and tokenizes only from where the last one ended. index.json is written
last: a dataset without one is unfinished.

An output that already holds something is never replaced without `overwrite`: a
finished dataset (its index.json), an unfinished one of other inputs, tokenizer or
settings (it says which), or files that are not a dataset. Only an unfinished run of
the same plan is taken up again as it is. `overwrite` removes the old dataset's index,
shards and records before anything is written, so no stale shard outlives it.
"""

from __future__ import annotations

import contextlib
import glob as globlib
import hashlib
import json
import os
import pickle
import re
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spotline.config.redact import redact
from spotline.data.errors import DataError, storage_kwargs
from spotline.data.textfiles import (
    TEXT_SAMPLE_BYTES,
    local_files,
    not_text,
    stdlib_files,
    stdlib_root,
    text_problem,
)
from spotline.data.tokenizer import Tokenizer
from spotline.data.tokens import (
    FORMAT,
    INDEX_NAME,
    PARTS_DIR,
    READ_CHUNK,
    VERSION,
    join_uri,
    token_dtype,
)
from spotline.storage import UnsafePathError, files_under, join_under, some_names
from spotline.storage.fs import explain_read_error, is_remote, local_path

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
ALL_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
PART_BYTES = 1 << 20
"""Input bytes per unit of work (a group of text files, a JSONL range, row groups)."""
ENCODE_BATCH_BYTES = 1 << 20
_SHARD_RE = re.compile(r"^shard-(\d+)(\.docs)?\.npy$")


def _format(name: str) -> str | None:
    low = name.lower()
    if low.endswith(TEXT_SUFFIXES):
        return "text"
    if low.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if low.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None


def separator_id(tokenizer: Tokenizer) -> int:
    """The token after every document: the tokenizer's end-of-text token, or b"\\n" (10)
    for the byte tokenizer."""
    if tokenizer.eos_id is not None:
        return int(tokenizer.eos_id)
    if tokenizer.sha256 == "byte":
        return 10
    raise DataError(
        f"tokenizer: {tokenizer!r} has no end-of-text token to end documents with; give it "
        "one (train_bpe's special_tokens, or eos_token in tokenizer_config.json)"
    )


# --- the input --------------------------------------------------------------------------


@dataclass(frozen=True)
class InputFile:
    path: str  # for the filesystem
    name: str  # relative to the input root, for messages and the listing
    size: int
    format: str
    mtime: str  # only to tell whether a resume may reuse the shards


def _list_inputs(source: str, fs, remote: bool) -> list[InputFile]:
    """The input's files in a fixed order; DataError when there are none."""
    if source == "stdlib":  # Python's own sources, as the text corpus reads them
        paths, base = [str(p) for p in stdlib_files(TEXT_SUFFIXES)], stdlib_root()
    elif remote:
        _, root_path = _split_remote(source, fs)
        try:
            if globlib.has_magic(root_path):
                paths, base = sorted(fs.glob(root_path)), _glob_base(root_path)
            elif fs.isfile(root_path):
                paths, base = [root_path], root_path.rsplit("/", 1)[0]
            else:
                paths = sorted(p for p in fs.find(root_path) if _format(p))
                base = root_path
                if not paths:
                    fs.info(root_path)  # raise if it does not exist at all
        except FileNotFoundError:
            raise DataError(f"input {source} does not exist; check the URI") from None
        except Exception as e:  # noqa: BLE001 - any backend error means unreadable
            raise DataError(f"input: {redact(explain_read_error(source, e))}") from None
    else:
        given = str(local_path(source))
        if globlib.has_magic(given):
            paths = sorted(p for p in globlib.glob(given, recursive=True) if os.path.isfile(p))
            base = _glob_base(given)
        else:
            root = Path(given)
            if not root.exists():
                raise DataError(
                    f"input {source} does not exist; give a file, directory, glob or URI"
                )
            paths = [str(p) for p in local_files(root, ALL_SUFFIXES)]
            base = str(root if root.is_dir() else root.parent)
    out = []
    for p in paths:
        fmt = _format(p)
        if fmt is None:
            raise DataError(
                f"input {p}: unknown format; use text ({' '.join(TEXT_SUFFIXES)}), JSON lines "
                f"({' '.join(JSONL_SUFFIXES)}) or Parquet (.parquet)"
            )
        try:
            info = fs.info(p)
        except Exception as e:  # noqa: BLE001
            raise DataError(f"input: {redact(explain_read_error(p, e))}") from None
        rel = os.path.relpath(p, base) if not remote else p[len(base) :].lstrip("/")
        mtime = str(info.get("mtime") or info.get("LastModified") or info.get("ETag") or "")
        out.append(InputFile(p, rel or os.path.basename(p), int(info["size"]), fmt, mtime))
    if not out:
        raise DataError(
            f"input {source}: no files to prepare; give text ({' '.join(TEXT_SUFFIXES)}), "
            f"JSON lines ({' '.join(JSONL_SUFFIXES)}) or Parquet (.parquet) files"
        )
    return out


def _check_text(files: list[InputFile], fs) -> None:
    """Refuse, before any work starts, a text input whose first bytes are not text."""
    for f in files:
        if f.format != "text":
            continue
        try:
            head = fs.cat_file(f.path, start=0, end=min(f.size, TEXT_SAMPLE_BYTES))
        except Exception as e:  # noqa: BLE001
            raise DataError(f"input: {redact(explain_read_error(f.path, e))}") from None
        why = text_problem(head, final=f.size <= TEXT_SAMPLE_BYTES)
        if why is not None:
            raise DataError(not_text(f"input {f.name}", why))


def _glob_base(pattern: str) -> str:
    """The directory part of a glob before its first wildcard."""
    parts = pattern.split("/")
    keep = []
    for part in parts[:-1]:
        if globlib.has_magic(part):
            break
        keep.append(part)
    return "/".join(keep)


def _split_remote(uri: str, fs) -> tuple[str, str]:
    protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    return protocol, fs._strip_protocol(uri)


def _filesystem(uri: str, endpoint_url, storage_options, what: str):
    import fsspec

    opts = storage_kwargs(
        uri, endpoint_url=endpoint_url, storage_options=storage_options,
        options_field="storage_options",
    )  # fmt: skip
    try:
        if is_remote(uri):
            return fsspec.core.url_to_fs(uri, **opts)
        return fsspec.filesystem("file"), str(local_path(uri).resolve())
    except Exception as e:  # noqa: BLE001 - an unknown protocol, a missing package
        raise DataError(f"{what}: {redact(explain_read_error(uri, e))}") from None


def _import_pyarrow():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            "reading Parquet needs the package 'pyarrow', which is not installed; run: pip "
            "install pyarrow"
        ) from None
    return pq


def _plan_parts(files: list[InputFile], fs, column: str) -> list[tuple]:
    """Units of work, fixed by the input alone: ("text", [file indices]),
    ("jsonl", file, start, stop) and ("parquet", file, [row groups]), with their
    input bytes last (for progress)."""
    parts: list[tuple] = []
    group: list[int] = []
    group_bytes = 0

    def flush() -> None:
        nonlocal group, group_bytes
        if group:
            parts.append(("text", tuple(group), group_bytes))
        group, group_bytes = [], 0

    for i, f in enumerate(files):
        if f.format == "text":
            group.append(i)
            group_bytes += f.size
            if group_bytes >= PART_BYTES:
                flush()
            continue
        flush()
        if f.format == "jsonl":
            for start in range(0, max(f.size, 1), PART_BYTES):
                stop = min(start + PART_BYTES, f.size)
                parts.append(("jsonl", i, start, stop, stop - start))
        else:
            pq = _import_pyarrow()
            try:
                with fs.open(f.path, "rb") as fh:
                    pf = pq.ParquetFile(fh)
                    meta, schema = pf.metadata, pf.schema_arrow
            except Exception as e:  # noqa: BLE001 - not Parquet, unreadable
                raise DataError(f"input {f.name}: not a readable Parquet file ({e})") from None
            if column not in schema.names:
                raise DataError(
                    f"input {f.name}: no column {column!r} (it has: "
                    f"{', '.join(schema.names)}); set column (spotline prepare --column)"
                )
            groups: list[int] = []
            size = 0
            for g in range(meta.num_row_groups):
                groups.append(g)
                size += meta.row_group(g).total_byte_size
                if size >= PART_BYTES:
                    parts.append(("parquet", i, tuple(groups), size))
                    groups, size = [], 0
            if groups:
                parts.append(("parquet", i, tuple(groups), size))
    flush()
    return parts


# --- tokenizing one part (in a worker process, or in this one) ---------------------------


class _Work:
    """What every part needs: set once per worker process."""

    def __init__(self, tokenizer, fs, files, text_field, column, sep, dtype):
        self.tokenizer = tokenizer
        self.fs = fs
        self.files = files
        self.text_field = text_field
        self.column = column
        self.sep = sep
        self.dtype = dtype


_WORK: _Work | None = None


def _init_worker(work: _Work) -> None:
    global _WORK
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    _WORK = work


def _tokenize_part(part: tuple) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, document lengths) of one part: each document's tokens + the separator."""
    w = _WORK
    assert w is not None
    tokens: list[np.ndarray] = []
    lengths: list[int] = []
    batch: list[str] = []
    batch_bytes = 0

    def encode() -> None:
        nonlocal batch, batch_bytes
        for ids in w.tokenizer.encode_batch(batch):
            arr = np.empty(len(ids) + 1, dtype=w.dtype)
            arr[:-1] = ids
            arr[-1] = w.sep
            tokens.append(arr)
            lengths.append(arr.size)
        batch, batch_bytes = [], 0

    for text in _documents(w, part):
        batch.append(text)
        batch_bytes += len(text)
        if batch_bytes >= ENCODE_BATCH_BYTES:
            encode()
    if batch:
        encode()
    flat = np.concatenate(tokens) if tokens else np.zeros(0, dtype=w.dtype)
    if flat.size and int(flat.max()) >= w.tokenizer.vocab_size:
        raise DataError(
            f"tokenizer: {w.tokenizer!r} produced id {int(flat.max())}, outside its "
            f"vocab_size ({w.tokenizer.vocab_size}); fix the tokenizer's vocab_size"
        )
    return flat, np.asarray(lengths, dtype=np.int64)


def _documents(w: _Work, part: tuple) -> Iterator[str]:
    kind = part[0]
    if kind == "text":
        for i in part[1]:
            f = w.files[i]
            try:
                raw = w.fs.cat_file(f.path)
            except Exception as e:  # noqa: BLE001
                raise DataError(f"input: {redact(explain_read_error(f.path, e))}") from None
            why = text_problem(raw)  # past the head that was checked before the work began
            if why is not None:
                raise DataError(not_text(f"input {f.name}", why))
            yield raw.decode("utf-8")
    elif kind == "jsonl":
        yield from _jsonl(w, w.files[part[1]], part[2], part[3])
    else:
        yield from _parquet(w, w.files[part[1]], part[2])


def _jsonl(w: _Work, f: InputFile, start: int, stop: int) -> Iterator[str]:
    """The documents of the lines that start in [start, stop)."""
    try:
        fh = w.fs.open(f.path, "rb", block_size=READ_CHUNK)
    except Exception as e:  # noqa: BLE001
        raise DataError(f"input: {redact(explain_read_error(f.path, e))}") from None
    with fh:
        pos = start
        if start > 0:
            fh.seek(start - 1)
            pos = start - 1 + len(fh.readline())  # the line that started before `start`
        while pos < stop:
            line = fh.readline()
            if not line:
                break
            at, pos = pos, pos + len(line)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise DataError(
                    f"input {f.name}: the line at byte {at} is not JSON ({e}); one JSON "
                    "object per line"
                ) from None
            if not isinstance(row, dict) or w.text_field not in row:
                have = ", ".join(list(row)[:10]) if isinstance(row, dict) else type(row).__name__
                raise DataError(
                    f"input {f.name}: the line at byte {at} has no field {w.text_field!r} "
                    f"(it has: {have}); set text_field (spotline prepare --field)"
                )
            text = row[w.text_field]
            if not isinstance(text, str):
                raise DataError(
                    f"input {f.name}: field {w.text_field!r} of the line at byte {at} is "
                    f"{type(text).__name__}, not a string"
                )
            yield text


def _parquet(w: _Work, f: InputFile, groups: tuple[int, ...]) -> Iterator[str]:
    pq = _import_pyarrow()
    try:
        with w.fs.open(f.path, "rb") as fh:
            table = pq.ParquetFile(fh).read_row_groups(list(groups), columns=[w.column])
    except Exception as e:  # noqa: BLE001
        raise DataError(f"input {f.name}: cannot read Parquet row groups ({e})") from None
    col = table.column(w.column)
    values = col.to_pylist()
    for row, text in enumerate(values):
        if not isinstance(text, str):
            raise DataError(
                f"input {f.name}: column {w.column!r} holds {type(text).__name__} (a "
                f"{col.type} column; row {row} of row groups {list(groups)}), not strings; "
                "set column to a text column"
            )
        yield text


# --- writing ------------------------------------------------------------------------------


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


class _Out:
    """The output directory through fsspec; local files are written under a temp name
    and renamed, remote objects appear whole when their upload completes."""

    def __init__(self, uri: str, endpoint_url, storage_options):
        self.uri = uri
        self.fs, self.root = _filesystem(uri, endpoint_url, storage_options, "out")
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


_PLAN_NAME = f"{PARTS_DIR}/plan.json"
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


def _claim(out: _Out, record: dict, overwrite: bool) -> tuple[list[dict], tuple[int, int]]:
    """Make `out` this run's: (recorded shards to keep, where to start). Refuses (unless
    `overwrite`) anything already there but an unfinished run of the same plan;
    `overwrite` removes the old dataset's files, its index first."""
    found = files_under(out.fs, out.root)
    if found == [""]:
        raise DataError(f"--out {out.uri} is a file; give a directory for the dataset")
    raw = out.read(_PLAN_NAME) if found else None
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


def _about(out: _Out) -> str:
    """A few words on the finished dataset at `out`, from its index."""
    try:
        index = json.loads(out.read(INDEX_NAME) or b"{}")
        return (
            f"{int(index['total_tokens']):,} tokens, tokenizer "
            f"{str(index['tokenizer_sha256'])[:12]}, from {index['inputs'][0]['uri']}"
        )
    except (ValueError, KeyError, TypeError, IndexError):
        return INDEX_NAME


def _resume_point(out: _Out) -> tuple[list[dict], tuple[int, int]]:
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


def prepare(
    input: str,
    tokenizer: Tokenizer,
    out: str,
    *,
    text_field: str = "text",
    column: str | None = None,
    workers: int | None = None,
    shard_tokens: int = 2**26,
    endpoint_url: str | None = None,
    storage_options: dict | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> dict:
    """Tokenize `input` with `tokenizer` into a sharded token dataset at `out` (a local
    path or fsspec URI); returns its index. `endpoint_url` / `storage_options` apply to
    s3:// input and output. Resumes an interrupted run at `out` (same input and
    tokenizer); anything else already at `out` is refused unless `overwrite`. The
    output is identical whatever `workers` (default: this machine's cores).

    Workers are spawned processes, never forked (the tokenizers library's threads do
    not survive a fork). As with any spawned process pool, they import the caller's
    __main__ module again: a script that calls this with workers > 1 needs an
    `if __name__ == "__main__":` guard, and keeps heavy imports under it."""
    if shard_tokens < 1:
        raise DataError(f"shard_tokens must be >= 1, got {shard_tokens}")
    sep = separator_id(tokenizer)
    dtype = token_dtype(tokenizer.vocab_size)
    column = column or text_field
    in_fs, _ = (
        (_filesystem(input, endpoint_url, storage_options, "input"))
        if input != "stdlib"
        else (_filesystem(stdlib_root(), None, None, "input"))
    )
    files = _list_inputs(input, in_fs, is_remote(input) and input != "stdlib")
    _check_text(files, in_fs)
    parts = _plan_parts(files, in_fs, column)
    listing = "".join(f"{f.name}\t{f.size}\t{f.format}\n" for f in files).encode()
    inputs = [
        {
            "uri": redact(input),  # the index is read by anyone who reads the dataset
            "files": len(files),
            "bytes": sum(f.size for f in files),
            "listing_sha256": hashlib.sha256(listing).hexdigest(),
            "text_field": text_field,
            "column": column,
        }
    ]
    plan = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer_sha256": tokenizer.sha256,
        "vocab_size": tokenizer.vocab_size,
        "separator": sep,
        "dtype": dtype.name,
        "shard_tokens": shard_tokens,
        "inputs": inputs,
        "parts": [list(p[:-1]) for p in parts],
        "mtimes": [f.mtime for f in files],
    }
    record = {
        "plan_sha256": hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest(),
        "tokenizer_sha256": tokenizer.sha256,
        "input": input,
        "listing_sha256": inputs[0]["listing_sha256"],
        "mtimes_sha256": hashlib.sha256(json.dumps(plan["mtimes"]).encode()).hexdigest(),
        "text_field": text_field,
        "column": column,
        "shard_tokens": shard_tokens,
    }
    o = _Out(out, endpoint_url, storage_options)
    done, (p0, off0) = _claim(o, record, overwrite)
    o.write_json(_PLAN_NAME, record)
    work = _Work(tokenizer, in_fs, files, text_field, column, sep, dtype)
    writer = _ShardWriter(o, shard_tokens, dtype, start=(p0, off0), first_shard=len(done))
    shards = [r["entry"] for r in done]
    tokens = sum(s["tokens"] for s in shards)
    with _progress(progress, sum(p[-1] for p in parts), sum(p[-1] for p in parts[:p0])) as bar:
        for p, (toks, lens) in _run(work, parts, p0, workers):
            skip = off0 if p == p0 else 0
            shards.extend(writer.add(p, toks, lens, skip=skip))
            tokens += int(toks.size) - skip
            bar(parts[p][-1], tokens)
        shards.extend(writer.finish(len(parts)))
    for name in o.listdir():  # shards of an earlier, larger run of this output
        m = _SHARD_RE.match(name)
        if m and int(m.group(1)) >= len(shards):
            o.remove(name)
    index = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype.name,
        "vocab_size": int(tokenizer.vocab_size),
        "eos_id": None if tokenizer.eos_id is None else int(tokenizer.eos_id),
        "doc_separator": sep,
        "tokenizer_sha256": tokenizer.sha256,
        "total_tokens": sum(s["tokens"] for s in shards),
        "documents": sum(s["documents"] for s in shards),
        "shard_tokens": shard_tokens,
        "shards": shards,
        "inputs": inputs,
    }
    o.write_json(INDEX_NAME, index)  # last: its presence means the dataset is whole
    return index


class _ShardWriter:
    """Cuts the concatenated parts into shards of exactly `shard_tokens` (the last one
    shorter), writing each with its document starts and a resume record."""

    def __init__(
        self, out: _Out, shard_tokens: int, dtype, start: tuple[int, int], first_shard: int
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


def _default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _run(work: _Work, parts: list[tuple], p0: int, workers: int | None):
    """(part index, (tokens, lengths)) for parts p0..., in order."""
    global _WORK
    todo = list(range(p0, len(parts)))
    n = max(1, min(workers or _default_workers(), len(todo)))
    if n == 1:
        saved, _WORK = _WORK, work
        try:
            for p in todo:
                yield p, _tokenize_part(parts[p])
        finally:
            _WORK = saved
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    try:  # it travels to the workers as their initializer's argument
        pickle.dumps(work)
    except Exception as e:  # noqa: BLE001 - a custom tokenizer that cannot be pickled
        raise DataError(
            f"the tokenizer cannot be sent to worker processes ({e}); use workers=1"
        ) from None
    ctx = mp.get_context("spawn")  # no fork of a process whose tokenizer threads are live
    with ProcessPoolExecutor(n, mp_context=ctx, initializer=_init_worker, initargs=(work,)) as pool:
        pending: deque = deque()
        it = iter(todo)
        try:
            for p in it:
                pending.append((p, pool.submit(_tokenize_part, parts[p])))
                if len(pending) >= 2 * n:  # bounded: results are consumed in order
                    q, fut = pending.popleft()
                    yield q, fut.result()
            while pending:
                q, fut = pending.popleft()
                yield q, fut.result()
        finally:
            for _, fut in pending:
                fut.cancel()


@contextlib.contextmanager
def _progress(enabled: bool, total: int, done: int):
    """A rich progress bar on stderr; yields update(input_bytes, tokens_so_far)."""
    if not enabled:
        yield lambda nbytes, tokens: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(
        TextColumn("prepare"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TextColumn("{task.fields[tokens]:,} tokens"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=False,
    ) as bar:
        task = bar.add_task("prepare", total=max(total, 1), completed=done, tokens=0)

        def update(nbytes: int, tokens: int) -> None:
            bar.update(task, advance=nbytes, tokens=tokens)

        yield update
