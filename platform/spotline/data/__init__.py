"""Training data: tokenizers, prepared token datasets, text corpora, sampling, prefetch.

    tok = job_tokenizer(spec)               # the job's tokenizer (byte or tokenizer.json)
    ds = open_dataset(spec, tok)            # data.kind 'text' or 'tokens' (or your own)
    sampler = Sampler(ds.train, seq_len, micro_batch_size, seed)
    with Prefetcher(lambda k: sampler.micro_batches(k, r, d, m)) as pf:
        batches, stall_s = pf.get(step)

Names are imported on first use, so importing the package (e.g. in a `prepare`
worker process) pulls in neither torch nor the tokenizers library. Preparing a
dataset: `spotline.data.prepare.prepare(input, tokenizer, out)`, which orchestrates
prepare_inputs (listing, formats, parts), prepare_workers (tokenizing the parts) and
prepare_output (the output, its records, the shard writer).

Reads go through `spotline.storage` (paths from an index never leave their root). It
must never import models, train/, the runtime or checkpoint/, nor write anywhere but
data.cache_dir and the `--out` that `prepare` was given.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from spotline.data.errors import CorpusError, DataError, ShardError

if TYPE_CHECKING:
    from spotline.config.schema import JobSpec
    from spotline.data.loader import Prefetcher
    from spotline.data.sampler import Sampler
    from spotline.data.streams import ArrayStream, Mixture, ShardedStream, TokenStream
    from spotline.data.text import TextDataset, load_corpus
    from spotline.data.tokenizer import (
        ByteTokenizer,
        HuggingFaceTokenizer,
        Tokenizer,
        job_tokenizer,
        load_tokenizer,
        load_tokenizer_at,
        train_bpe,
    )
    from spotline.data.tokens import TokenDataset, read_index

_LAZY = {
    "load_corpus": "text",
    "TextDataset": "text",
    "Prefetcher": "loader",
    "Sampler": "sampler",
    "ArrayStream": "streams",
    "Mixture": "streams",
    "ShardedStream": "streams",
    "TokenStream": "streams",
    "ByteTokenizer": "tokenizer",
    "HuggingFaceTokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
    "job_tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "load_tokenizer_at": "tokenizer",
    "train_bpe": "tokenizer",
    "TokenDataset": "tokens",
    "read_index": "tokens",
}

__all__ = [
    "ArrayStream",
    "ByteTokenizer",
    "CorpusError",
    "DataError",
    "Dataset",
    "HuggingFaceTokenizer",
    "Mixture",
    "Prefetcher",
    "Sampler",
    "ShardError",
    "ShardedStream",
    "TextDataset",
    "TokenDataset",
    "TokenStream",
    "Tokenizer",
    "job_tokenizer",
    "load_corpus",
    "load_tokenizer",
    "load_tokenizer_at",
    "open_dataset",
    "read_index",
    "train_bpe",
]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'spotline.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"spotline.data.{module}"), name)
    globals()[name] = value
    return value


@runtime_checkable
class Dataset(Protocol):
    """What `open_dataset` returns (TextDataset, TokenDataset, or a data kind of your
    own): the train and held-out token streams, and what they were tokenized with."""

    train: TokenStream
    heldout: TokenStream
    vocab_size: int
    tokenizer_sha256: str | None

    def describe(self) -> dict[str, Any]: ...


def open_dataset(spec: JobSpec, tokenizer: Tokenizer | None = None) -> Dataset:
    """The job's dataset, built by the data kind registered under data.kind
    (`spotline.registry.DATASETS`): called as `cls(spec, tokenizer)`."""
    from spotline.registry import DATASETS

    try:
        cls = DATASETS.load(spec.data.kind, "data.kind")
    except ValueError as e:
        raise DataError(str(e)) from None
    return cls(spec, tokenizer)
