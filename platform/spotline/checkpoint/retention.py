"""checkpoint.keep_last: which steps go, carried out against the catalog.

Only the commit coordinator applies it (ARCHITECTURE: it owns receipts -> manifest ->
retention -> quarantine -> restore fallback). It must never delete an upload that may
still be running (an uncommitted step newer than the newest commit), a step a reader
still pins, or a quarantined step (kept for inspection, never counted); and a committed
step loses its manifest before its files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from spotline.checkpoint import catalog
from spotline.checkpoint.storage import StepStorage


def plan_retention(
    steps: list[int],
    committed: list[int],
    keep_last: int,
    pinned: Iterable[int] = (),
    quarantined: Callable[[int], bool] = lambda step: False,
) -> tuple[list[int], list[int]]:
    """(expired, abandoned): the committed steps past the newest `keep_last` that no
    reader pins, and the uncommitted steps older than the newest commit that hold no
    quarantine record. `steps`: every step directory, ascending; `committed`: those
    with a manifest, ascending; `quarantined(step)` is asked only of an uncommitted
    step older than the newest commit."""
    if keep_last < 1:
        raise ValueError(f"checkpoint.keep_last must be >= 1 (got {keep_last})")
    if not committed:
        return [], []
    newest = committed[-1]
    held = set(pinned)
    expired = [s for s in committed[:-keep_last] if s not in held]
    committed_set = set(committed)
    abandoned = [s for s in steps if s not in committed_set and s < newest and not quarantined(s)]
    return expired, abandoned


def apply_retention(storage: StepStorage, keep_last: int, pinned: Iterable[int] = ()) -> list[int]:
    """Delete all but the newest ``keep_last`` committed steps, and abandoned uploads.
    A quarantined step is not committed: it neither counts nor goes.

    A committed step in ``pinned`` (one a reader still uses) is kept past
    ``keep_last`` until a later call no longer pins it. An uncommitted step older
    than the newest commit is abandoned and deleted; one newer than it may still
    be uploading and is left alone. A committed step loses its manifest before its
    files. Returns the deleted steps.
    """
    if keep_last < 1:
        raise ValueError(f"checkpoint.keep_last must be >= 1 (got {keep_last})")
    steps = catalog.step_dirs(storage)
    committed = [s for s in steps if catalog.is_committed(storage, s)]
    expired, abandoned = plan_retention(
        steps,
        committed,
        keep_last,
        pinned,
        lambda s: catalog.holds_quarantine_record(storage, s),
    )
    for step in expired:
        catalog.delete_committed(storage, step)
    for step in abandoned:
        catalog.delete_step_dir(storage, step)
    return sorted(expired + abandoned)
