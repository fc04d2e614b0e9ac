"""checkpoint.keep_last: which steps go, carried out against the catalog.

Only the commit coordinator applies it (ARCHITECTURE: it owns receipts -> manifest ->
retention -> quarantine -> restore fallback). It counts only steps whose manifest
verifies (`catalog.list_steps`), so a planted or corrupt manifest at a high step never
expires good steps nor makes uploads below it look abandoned. It must never delete an
upload that may still be running (an uncommitted step newer than the newest commit), a
step a reader still pins, a quarantined step (kept for inspection, never counted) or a
damaged one (the coordinator quarantines it); and a committed step loses its manifest
before its files.
"""

from __future__ import annotations

from collections.abc import Iterable

from spotline.checkpoint import catalog
from spotline.checkpoint.catalog import Steps
from spotline.storage.checkpoint_root import StepStorage


def plan_retention(
    steps: Steps, keep_last: int, pinned: Iterable[int] = ()
) -> tuple[list[int], list[int]]:
    """(expired, abandoned): the committed steps past the newest `keep_last` that no
    reader pins, and the uncommitted steps (no manifest, no quarantine record) older
    than the newest commit. Damaged and quarantined steps are neither."""
    if keep_last < 1:
        raise ValueError(f"checkpoint.keep_last must be >= 1 (got {keep_last})")
    if not steps.committed:
        return [], []
    newest = steps.committed[-1]
    held = set(pinned)
    expired = [s for s in steps.committed[:-keep_last] if s not in held]
    abandoned = [s for s in steps.uncommitted if s < newest]
    return expired, abandoned


def apply_retention(
    storage: StepStorage, keep_last: int, pinned: Iterable[int] = (), steps: Steps | None = None
) -> list[int]:
    """Delete all but the newest ``keep_last`` committed steps, and abandoned uploads.
    A quarantined or damaged step is not committed: it neither counts nor goes.

    A committed step in ``pinned`` (one a reader still uses) is kept past
    ``keep_last`` until a later call no longer pins it. An uncommitted step older
    than the newest commit is abandoned and deleted; one newer than it may still
    be uploading and is left alone. A committed step loses its manifest before its
    files. `steps`: the caller's listing, when it has one. Returns the deleted steps.
    """
    if keep_last < 1:
        raise ValueError(f"checkpoint.keep_last must be >= 1 (got {keep_last})")
    expired, abandoned = plan_retention(
        steps if steps is not None else catalog.list_steps(storage), keep_last, pinned
    )
    for step in expired:
        catalog.delete_committed(storage, step)
    for step in abandoned:
        catalog.delete_step_dir(storage, step)
    return sorted(expired + abandoned)
