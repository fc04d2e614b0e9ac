"""Tokenizing `prepare`'s parts: in a pool of spawned worker processes (each set up once
with the tokenizer and the input's filesystem), or in this process for one worker; the
results come back in part order. Also the progress bar.

Spawned worker processes find `Work`, the initializer and the tokenizing function by
their import path here. It must never write the output.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
from collections import deque
from collections.abc import Iterator

import numpy as np

from spotline.config.redact import redact
from spotline.data.errors import DataError
from spotline.data.prepare_inputs import InputFile, import_pyarrow
from spotline.data.textfiles import not_text, text_problem
from spotline.data.tokens import READ_CHUNK
from spotline.storage.fs import explain_read_error

ENCODE_BATCH_BYTES = 1 << 20


class Work:
    """What every part needs: set once per worker process."""

    def __init__(self, tokenizer, fs, files, text_field, column, sep, dtype):
        self.tokenizer = tokenizer
        self.fs = fs
        self.files = files
        self.text_field = text_field
        self.column = column
        self.sep = sep
        self.dtype = dtype


_WORK: Work | None = None


def _init_worker(work: Work) -> None:
    global _WORK
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    _WORK = work


def tokenize_part(part: tuple) -> tuple[np.ndarray, np.ndarray]:
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


def _documents(w: Work, part: tuple) -> Iterator[str]:
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


def _jsonl(w: Work, f: InputFile, start: int, stop: int) -> Iterator[str]:
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


def _parquet(w: Work, f: InputFile, groups: tuple[int, ...]) -> Iterator[str]:
    pq = import_pyarrow()
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


def _default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def run_parts(work: Work, parts: list[tuple], p0: int, workers: int | None, tokenize=tokenize_part):
    """(part index, (tokens, lengths)) for parts p0..., in order, each from `tokenize`
    (sent to the worker processes by its import path)."""
    global _WORK
    todo = list(range(p0, len(parts)))
    n = max(1, min(workers or _default_workers(), len(todo)))
    if n == 1:
        saved, _WORK = _WORK, work
        try:
            for p in todo:
                yield p, tokenize(parts[p])
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
                pending.append((p, pool.submit(tokenize, parts[p])))
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
def progress_bar(enabled: bool, total: int, done: int):
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
