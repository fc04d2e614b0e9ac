"""The data package's errors (re-exported by `spotline.data`)."""

from __future__ import annotations


class DataError(ValueError):
    """Training data or a tokenizer cannot be used. The message is one line that names
    the spec field (data.corpus, data.uri, tokenizer.path, ...) and the fix."""


CorpusError = DataError
"""The former name (a text corpus that cannot be read): the same class, so code that
catches either catches every data error."""


class ShardError(DataError):
    """A shard of a prepared dataset is missing, truncated or fails its sha256. The
    message names the shard's URI and what is wrong: Spotline never trains on it."""
