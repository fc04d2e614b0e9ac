"""The data package's errors (re-exported by `spotline.data`), and the storage layer's
filesystem options as data sees them (a refusal is a DataError)."""

from __future__ import annotations

from spotline.config.redact import redact
from spotline.storage.fs import StorageOptionsError, filesystem_options


class DataError(ValueError):
    """Training data or a tokenizer cannot be used. The message is one line that names
    the spec field (data.corpus, data.uri, tokenizer.path, ...) and the fix."""


CorpusError = DataError
"""The former name (a text corpus that cannot be read): the same class, so code that
catches either catches every data error."""


class ShardError(DataError):
    """A shard of a prepared dataset is missing, truncated or fails its sha256. The
    message names the shard's URI and what is wrong: Spotline never trains on it."""


def storage_kwargs(
    uri: str,
    *,
    endpoint_url: str | None = None,
    storage_options: dict | None = None,
    options_field: str = "data.storage_options",
) -> dict:
    """`spotline.storage.fs.filesystem_options`, a refusal reported as a DataError."""
    try:
        return filesystem_options(
            uri,
            endpoint_url=endpoint_url,
            storage_options=storage_options,
            options_field=options_field,
        )
    except StorageOptionsError as e:
        raise DataError(redact(str(e))) from None
