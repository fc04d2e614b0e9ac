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

This module is the orchestration; the input side is in `prepare_inputs`, the
tokenizing in `prepare_workers`, the output side in `prepare_output`.
"""

from __future__ import annotations

import hashlib
import json

from spotline.config.redact import redact
from spotline.data.errors import DataError
from spotline.data.prepare_inputs import (
    ALL_SUFFIXES,
    JSONL_SUFFIXES,
    PARQUET_SUFFIXES,
    PART_BYTES,
    TEXT_SUFFIXES,
    check_text,
    filesystem,
    list_inputs,
    plan_parts,
)
from spotline.data.prepare_inputs import import_pyarrow as _import_pyarrow  # noqa: F401
from spotline.data.prepare_output import PLAN_NAME, SHARD_RE, Output, ShardWriter, claim
from spotline.data.prepare_workers import Work, progress_bar, run_parts
from spotline.data.prepare_workers import tokenize_part as _tokenize_part
from spotline.data.textfiles import stdlib_root
from spotline.data.tokenizer import Tokenizer
from spotline.data.tokens import FORMAT, INDEX_NAME, VERSION, token_dtype
from spotline.storage.fs import is_remote

__all__ = [
    "ALL_SUFFIXES",
    "JSONL_SUFFIXES",
    "PARQUET_SUFFIXES",
    "PART_BYTES",
    "TEXT_SUFFIXES",
    "prepare",
    "separator_id",
]
# `prepare` looks up PART_BYTES and _tokenize_part here when it runs, so setting them on
# this module changes the part size and how a part is tokenized (in this process).


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
        (filesystem(input, endpoint_url, storage_options, "input"))
        if input != "stdlib"
        else (filesystem(stdlib_root(), None, None, "input"))
    )
    files = list_inputs(input, in_fs, is_remote(input) and input != "stdlib")
    check_text(files, in_fs)
    parts = plan_parts(files, in_fs, column, PART_BYTES)
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
    o = Output(out, endpoint_url, storage_options)
    done, (p0, off0) = claim(o, record, overwrite)
    o.write_json(PLAN_NAME, record)
    work = Work(tokenizer, in_fs, files, text_field, column, sep, dtype)
    writer = ShardWriter(o, shard_tokens, dtype, start=(p0, off0), first_shard=len(done))
    shards = [r["entry"] for r in done]
    tokens = sum(s["tokens"] for s in shards)
    with progress_bar(progress, sum(p[-1] for p in parts), sum(p[-1] for p in parts[:p0])) as bar:
        for p, (toks, lens) in run_parts(work, parts, p0, workers, _tokenize_part):
            skip = off0 if p == p0 else 0
            shards.extend(writer.add(p, toks, lens, skip=skip))
            tokens += int(toks.size) - skip
            bar(parts[p][-1], tokens)
        shards.extend(writer.finish(len(parts)))
    for name in o.listdir():  # shards of an earlier, larger run of this output
        m = SHARD_RE.match(name)
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
