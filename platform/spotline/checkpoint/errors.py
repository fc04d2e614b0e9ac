"""What goes wrong with checkpoint storage, in words the user can act on.

`StorageError` (the storage cannot be used), `CorruptCheckpointError` (a file differs
from its manifest) and `CheckpointMismatchError` (another job's, or another spec's,
checkpoints), and `StoreFields`: what a store's settings are called in those messages.

Pure data: it never touches storage. A message built here never holds a secret.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from spotline.config.redact import redact


class StoreFields(NamedTuple):
    """What a store's settings are called in its messages: the spec's fields by default,
    or the command-line arguments that gave them (`argument`), so that a message names
    what the user actually typed."""

    uri: str = "checkpoint.uri"
    endpoint_url: str = "checkpoint.endpoint_url"
    storage_options: str | None = "checkpoint.storage_options"

    @classmethod
    def argument(cls, name: str) -> StoreFields:
        """A store named by the command-line argument `name` (no storage options)."""
        return cls(uri=f"the {name} argument", endpoint_url="--endpoint-url", storage_options=None)

    def credentials_fix(self) -> str:
        fix = "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an instance role"
        if self.storage_options:
            fix += f", or put key/secret (or profile) in {self.storage_options}"
        return fix


SPEC_FIELDS = StoreFields()


class StorageError(RuntimeError):
    """The checkpoint storage cannot be used: bad URI, unreachable, no credentials, no access.

    Worth retrying when it is an outage (unreachable, timed out); not when it is a bad
    URI, missing credentials or refused access. The message never holds a secret.
    """

    def __init__(self, message: str) -> None:
        super().__init__(redact(message))


class CheckpointMismatchError(ValueError):
    """The checkpoint URI holds checkpoints this job must not resume or write over (another
    job's, or this job's with a different model, data or training spec). Not retryable."""


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file is missing or its size/sha256 differs from the manifest.

    ``step`` and ``path`` name the first bad file; ``failures`` lists every
    ``(step, path, reason)`` found when several steps were tried.
    """

    def __init__(
        self,
        step: int,
        path: str,
        reason: str,
        *,
        uri: str = "",
        message: str | None = None,
        failures: list[tuple[int, str, str]] | None = None,
    ) -> None:
        self.step = step
        self.path = path
        self.reason = reason
        self.uri = uri
        self.failures = failures or [(step, path, reason)]
        where = f" at {uri}" if uri else ""
        super().__init__(message or f"checkpoint step {step}{where} is corrupt: {path}: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Ray ships exceptions between processes; the default reduce would call
        # __init__ with the message only.
        return (
            _rebuild_corrupt,
            (self.step, self.path, self.reason, self.uri, str(self), self.failures),
        )


def _rebuild_corrupt(
    step: int, path: str, reason: str, uri: str, message: str, failures: list
) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        step, path, reason, uri=uri, message=message, failures=[tuple(f) for f in failures]
    )
