"""Loading one committed step into a group, for the commit coordinator's restore: the
step must be one this spec may resume (`check_compatible`), and a load that fails for a
reason other than corruption, an outage or a dead worker is tried again a bounded
number of times (`load`), each try said."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from spotline.checkpoint.errors import CheckpointMismatchError, CorruptCheckpointError
from spotline.checkpoint.manifest import Manifest
from spotline.checkpoint.store import CheckpointStore
from spotline.config.schema import JobSpec
from spotline.storage.errors import StorageError
from spotline.storage.retry import retrying

Event = Callable[..., None]


class Restorable(Protocol):
    """What a restore needs of a worker group."""

    replicas: int
    attempt: str

    def restore(self, manifest: Manifest, source: str | None = None) -> int: ...


class StepLoader:
    """The coordinator's loads of one step, each said on the job's events."""

    def __init__(self, spec: JobSpec, store: CheckpointStore, event: Event, retries: int):
        self.spec, self.store, self._event, self.retries = spec, store, event, retries

    def load(
        self,
        group: Restorable,
        manifest: Manifest,
        sleep: Callable[[float], None],
        source: str | None = None,
    ) -> int:
        """group.restore, retried (`retries` more tries, 1 s apart, each one said) when it
        fails for a reason other than corruption, an outage or a dead worker (those go
        up: fall back, or restart the group). `source`: the root URI the step lies
        under, when it is not this job's own (checkpoint.resume_from)."""

        def say(attempt: int, e: BaseException) -> None:
            self._event(
                f"loading checkpoint step {manifest.step} failed ({e}); retrying "
                f"({attempt}/{self.retries})",
                logging.WARNING,
            )

        return retrying(
            lambda: group.restore(manifest, source) if source else group.restore(manifest),
            self.retries + 1,
            _load_error,
            wait_s=1.0,
            sleep=sleep,
            on_retry=say,
        )

    def check_compatible(self, m: Manifest, source: CheckpointStore | None = None) -> None:
        """Refuse a step this spec must not resume: another job's (unless it is the
        checkpoint.resume_from `source`), or another model, data or batch. A step that
        differs only in RETUNABLE_FIELDS loads, with those taken from this spec."""
        store = source or self.store
        retuned = self.spec.retuned_fields(m.spec_hash, m.extra.get("spec"))
        if retuned is None or (source is None and m.extra.get("job") != self.spec.name):
            raise CheckpointMismatchError(
                store.describe_mismatch(
                    self.spec,
                    None if source else m.extra.get("job"),
                    m.spec_hash,
                    m.extra.get("spec"),
                    m.step,
                )
            )
        if retuned:
            self._event(
                f"checkpoint step {m.step} was trained with other hyperparameters; going on "
                f"with this spec's: {'; '.join(retuned)}"
            )
        if "index" not in m.extra:
            raise CheckpointMismatchError(
                f"checkpoint step {m.step} at {self.store.uri} was written by an older "
                "Spotline (no sharded state index); resume it with that version, or point "
                "checkpoint.uri at a new location"
            )


def _load_error(e: BaseException) -> bool:
    """A load error worth retrying: not corruption or an outage (fall back or report),
    not a dead worker (restart the group); never the user's (the retry policy's rule)."""
    return not isinstance(e, (CorruptCheckpointError, StorageError)) and not getattr(
        e, "process_died", False
    )
