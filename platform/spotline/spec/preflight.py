"""Checks that touch the outside world, run before any worker starts.

A bad storage URI, missing credentials or an unreadable corpus must fail here,
in the driver, in seconds, with a message that names the field and the fix,
not minutes later inside a worker.
"""

from __future__ import annotations

from spotline.backfill.spec import resolve_prompts
from spotline.checkpoint import CheckpointStore
from spotline.data import load_corpus
from spotline.spec.loader import SpecError
from spotline.spec.models import JobSpec


def open_store(spec: JobSpec) -> CheckpointStore:
    c = spec.checkpoint
    return CheckpointStore(
        spec.resolved_checkpoint_uri(),
        endpoint_url=c.endpoint_url,
        storage_options=c.storage_options,
    )


def preflight(spec: JobSpec) -> CheckpointStore:
    """Validate storage (reachable, writable, credentials), the corpus and backfill
    prompts (read into the spec); return the store."""
    for i, task in enumerate(spec.backfill.tasks):
        if task.kind == "speculative":
            try:
                resolve_prompts(task, f"backfill.tasks[{i}]")
            except ValueError as e:
                raise SpecError(str(e)) from e
    store = open_store(spec)
    store.check_writable()
    load_corpus(spec.data, min_tokens=spec.model.seq_len + 2)
    return store
