"""What `prepare` reads: the input's files in a fixed order, their formats, a first look
that they are text, and the units of work (parts) cut from them by the input alone.

`filesystem` opens the output's filesystem too (prepare_output uses it). This module
must never tokenize or write anything.
"""

from __future__ import annotations

import glob as globlib
import os
from dataclasses import dataclass
from pathlib import Path

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
from spotline.storage.fs import explain_read_error, is_remote, local_path

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
ALL_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
PART_BYTES = 1 << 20
"""Input bytes per unit of work (a group of text files, a JSONL range, row groups)."""


def _format(name: str) -> str | None:
    low = name.lower()
    if low.endswith(TEXT_SUFFIXES):
        return "text"
    if low.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if low.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None


@dataclass(frozen=True)
class InputFile:
    path: str  # for the filesystem
    name: str  # relative to the input root, for messages and the listing
    size: int
    format: str
    mtime: str  # only to tell whether a resume may reuse the shards


def list_inputs(source: str, fs, remote: bool) -> list[InputFile]:
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


def check_text(files: list[InputFile], fs) -> None:
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
    from fsspec.core import strip_protocol

    protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    return protocol, strip_protocol(uri)


def filesystem(uri: str, endpoint_url, storage_options, what: str):
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


def import_pyarrow():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            "reading Parquet needs the package 'pyarrow', which is not installed; run: pip "
            "install pyarrow"
        ) from None
    return pq


def plan_parts(files: list[InputFile], fs, column: str, part_bytes: int) -> list[tuple]:
    """Units of work of about `part_bytes` input bytes, fixed by the input alone:
    ("text", [file indices]), ("jsonl", file, start, stop) and ("parquet", file,
    [row groups]), with their input bytes last (for progress)."""
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
            if group_bytes >= part_bytes:
                flush()
            continue
        flush()
        if f.format == "jsonl":
            for start in range(0, max(f.size, 1), part_bytes):
                stop = min(start + part_bytes, f.size)
                parts.append(("jsonl", i, start, stop, stop - start))
        else:
            pq = import_pyarrow()
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
                if size >= part_bytes:
                    parts.append(("parquet", i, tuple(groups), size))
                    groups, size = [], 0
            if groups:
                parts.append(("parquet", i, tuple(groups), size))
    flush()
    return parts
