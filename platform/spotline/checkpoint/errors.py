"""What goes wrong with checkpoints, in words the user can act on.

`CorruptCheckpointError` (a file differs from its manifest) and
`CheckpointMismatchError` (another job's, or another spec's, checkpoints). That the
storage itself cannot be used is `spotline.storage.errors.StorageError`.

Pure data: it never touches storage. A message built here never holds a secret.
"""

from __future__ import annotations

from typing import Any


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
