"""data.kind 'text': a small corpus read whole at start-up, split into train and held-out.

The default corpus is the source of Python's own standard library, so a job
runs with no download. A directory, file or fsspec URI of text works too.
Reading is deterministic: files in sorted order, joined with b"\n", truncated at
max_bytes. With the byte tokenizer the tokens are exactly those bytes; any other
tokenizer encodes each file as a document followed by its end-of-text token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from spotline.config.redact import redact
from spotline.config.sections import DataSpec
from spotline.data.errors import CorpusError, storage_kwargs
from spotline.data.streams import ArrayStream, split_point
from spotline.data.textfiles import local_files, not_text, stdlib_files, text_problem
from spotline.storage.fs import explain_read_error, is_remote, local_path, unreachable

if TYPE_CHECKING:
    from spotline.config.schema import JobSpec
    from spotline.data.tokenizer import Tokenizer

__all__ = [
    "Corpus",
    "CorpusError",
    "TextDataset",
    "fsspec_options",
    "load_corpus",
]


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # uint8 tokens
    heldout: np.ndarray
    source: str

    @property
    def total_bytes(self) -> int:
        return int(self.train.size + self.heldout.size)


def _read_local(root: Path, spec: DataSpec) -> list[bytes]:
    if not root.exists():
        raise CorpusError(
            f"data.corpus: {root} does not exist; point it at a directory or file of text, "
            "or use 'stdlib'"
        )
    try:
        files = local_files(root, tuple(spec.file_suffixes))
    except OSError as e:
        raise CorpusError(f"data.corpus: cannot list {root}: {e}") from None
    return _read_files(files, spec.max_bytes, root, lambda p: p.read_bytes())


def fsspec_options(uri: str, spec: DataSpec, field: str = "data.corpus") -> dict:
    """Keyword arguments of the corpus's fsspec filesystem: data.storage_options, plus
    data.endpoint_url for s3://; unknown S3 options are refused."""
    scheme = uri.split("://", 1)[0].lower()
    if spec.endpoint_url and scheme != "s3":
        raise CorpusError(f"data.endpoint_url is set but {field} {uri!r} is not s3://; remove it")
    opts = dict(spec.storage_options)
    if scheme == "s3":
        return storage_kwargs(uri, endpoint_url=spec.endpoint_url, storage_options=opts)
    return opts


def _read_fsspec(uri: str, spec: DataSpec) -> list[bytes]:
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
        down = unreachable(uri)
        if down:
            raise CorpusError(f"data.corpus: {down}") from None
        raise CorpusError(f"data.corpus: {uri} does not exist; check the URI") from None
    except Exception as e:  # noqa: BLE001 - any backend error means unreadable
        raise CorpusError(f"data.corpus: {redact(explain_read_error(uri, e))}") from None
    return _read_files(files, spec.max_bytes, uri, fs.cat_file)


def _read_files(files, max_bytes: int, where, read) -> list[bytes]:
    """The files' bytes, in order, until max_bytes are read (the last one whole)."""
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
        why = text_problem(data)
        if why is not None:
            raise CorpusError(
                f"data.corpus: {not_text(str(f), why)} (or narrow data.file_suffixes)"
            )
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
    return chunks


def _read_chunks(spec: DataSpec) -> list[bytes]:
    src = spec.corpus
    if src == "stdlib":
        files = stdlib_files(tuple(spec.file_suffixes))
        return _read_files(files, spec.max_bytes, "stdlib", lambda p: p.read_bytes())
    if is_remote(src):
        return _read_fsspec(src, spec)
    return _read_local(local_path(src), spec)


def read_documents(spec: DataSpec) -> list[bytes]:
    """The corpus's files as documents, in order, the last cut so that the documents
    and their b"\n" separators hold at most data.max_bytes."""
    docs: list[bytes] = []
    used = 0
    for i, chunk in enumerate(_read_chunks(spec)):
        used += 1 if i else 0  # the b"\n" before it
        if used >= spec.max_bytes:
            break
        docs.append(chunk[: spec.max_bytes - used])
        used += len(docs[-1])
    return docs


def load_corpus(spec: DataSpec, min_tokens: int = 0) -> Corpus:
    """Read and split the corpus as bytes. `min_tokens` is the smallest usable split size."""
    raw = b"\n".join(_read_chunks(spec))[: spec.max_bytes]
    arr = np.frombuffer(raw, dtype=np.uint8)
    split = split_point(arr.size, spec.heldout_fraction)
    corpus = Corpus(train=arr[:split], heldout=arr[split:], source=spec.corpus)
    _check_size(spec.corpus, arr.size, corpus.train.size, corpus.heldout.size, min_tokens, "bytes")
    return corpus


def _check_size(src: str, total: int, train: int, heldout: int, min_tokens: int, unit: str):
    if min(train, heldout) < min_tokens:
        raise CorpusError(
            f"data.corpus: {src} has {total} {unit}, too few for sequences of {min_tokens - 1} "
            f"tokens in both the train and held-out splits; add text, raise data.max_bytes or "
            "lower model.seq_len"
        )


class TextDataset:
    """data.kind 'text': the corpus read whole and tokenized with the job's tokenizer,
    as in-memory `.train` and `.heldout` streams (see `spotline.data.streams`).

    With the byte tokenizer the tokens are exactly `load_corpus`'s bytes (uint8), so a
    `Sampler` over `.train` draws what it drew from the byte array. Any other tokenizer
    encodes each file as one document followed by its end-of-text token (when it has
    one), the layout `spotline prepare` writes, and the split is by token position.
    """

    kind = "text"

    def __init__(
        self,
        spec: JobSpec,
        tokenizer: Tokenizer | None = None,
        *,
        min_tokens: int | None = None,
    ):
        from spotline.data.tokenizer import job_tokenizer

        d = spec.data
        self.tokenizer = tokenizer if tokenizer is not None else job_tokenizer(spec)
        need = spec.model.seq_len + 2 if min_tokens is None else min_tokens
        if self.tokenizer.sha256 == "byte":
            corpus = load_corpus(d, min_tokens=need)
            train, heldout = corpus.train, corpus.heldout
            unit_total = corpus.total_bytes
        else:
            tokens = encode_documents(self.tokenizer, read_documents(d))
            split = split_point(tokens.size, d.heldout_fraction)
            train, heldout = tokens[:split], tokens[split:]
            unit_total = tokens.size
            _check_size(d.corpus, unit_total, train.size, heldout.size, need, "tokens")
        self.train = ArrayStream(train)
        self.heldout = ArrayStream(heldout)
        self.vocab_size = self.tokenizer.vocab_size
        self.tokenizer_sha256 = self.tokenizer.sha256
        self.total_tokens = int(unit_total)
        self.source = d.corpus

    def describe(self) -> dict:
        return {
            "kind": "text",
            "corpus": self.source,
            "tokens": self.total_tokens,
            "train_tokens": self.train.size,
            "heldout_tokens": self.heldout.size,
            "tokenizer_sha256": self.tokenizer_sha256,
        }


def encode_documents(tokenizer: Tokenizer, docs: list[bytes]) -> np.ndarray:
    """Each document's tokens followed by the end-of-text token (if the tokenizer has
    one), concatenated, in the smallest unsigned dtype that holds the vocabulary."""
    from spotline.data.tokens import token_dtype

    texts = [d.decode("utf-8", errors="replace") for d in docs]
    eos = tokenizer.eos_id
    tail = [] if eos is None else [eos]
    ids = [np.asarray(t + tail, dtype=np.int64) for t in tokenizer.encode_batch(texts)]
    flat = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    return flat.astype(token_dtype(tokenizer.vocab_size))
