"""Where a job named on the command line is: a running job's controller on a Ray
cluster (the one this machine is on, or each of several), or a finished job's
checkpoint URI, from which its summary and trace are read back. A name that no running
controller answers to is looked up where that job last ran on this machine
(`spotline.job_index`). Used by `spotline status`, `report` and `trace`; it starts
nothing and writes nothing.
"""

from __future__ import annotations

import re
import sys

from spotline.config import SpecError
from spotline.runtime.cluster import cluster_candidates, connect_ray

_URI_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def is_uri(target: str) -> bool:
    """A URI or path (read from storage) rather than a running job's name. Job names
    hold no '/' or ':' (see `name` in the spec), so anything with one is a location."""
    from pathlib import Path

    return (
        bool(_URI_RE.match(target))
        or "/" in target
        or target.startswith(("~", "."))
        or Path(target).exists()
    )


def on_clusters(address: str, look):
    """Connect to each cluster `address` may mean (see `cluster_candidates`), the one
    already connected first, until `look()` finds something; (what it found, where)."""
    import ray

    candidates = cluster_candidates(address)
    here = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    if here in candidates:
        candidates.remove(here)
        candidates.insert(0, here)
    found, looked = None, False
    for i, where in enumerate(candidates):
        if ray.is_initialized() and where not in (here, None, "auto"):
            ray.shutdown()
        try:
            connect_ray(where)
        except ConnectionError:
            if i == len(candidates) - 1 and not looked:
                raise
            continue  # one of several local clusters going away: look at the others
        here, looked = ray.get_runtime_context().gcs_address, True
        found = look()
        if found:
            break
    return found, ", ".join(str(c) for c in candidates)


def live_controller(name: str, address: str):
    from spotline.controller.actor import find_controller

    controller, where = on_clusters(address, lambda: find_controller(name))
    if controller is None:
        raise SpecError(
            f"no running Spotline job named {name!r} on the Ray cluster at {where}; give "
            "the job's checkpoint URI instead to read a finished job"
        )
    return controller


def running_job(address: str) -> str:
    from spotline.controller.actor import running_jobs

    names: list[str] = []

    def look() -> None:  # every cluster: the job must be the only one on all of them
        names.extend(running_jobs())

    _, where = on_clusters(address, look)
    if len(names) != 1:
        found = ", ".join(sorted(names)) if names else "none"
        raise SpecError(
            f"name the job: running Spotline jobs on the Ray cluster at {where}: {found}. "
            "A finished job is read from its checkpoint URI"
        )
    return names[0]


def job_store(target: str, endpoint_url: str | None = None, signing_key_env: str | None = None):
    """The store of a finished job at `target`; SpecError when nothing of a job is there."""
    from spotline.checkpoint import SUMMARY_ARTIFACT, CheckpointStore, StoreFields

    store = CheckpointStore(
        target,
        endpoint_url=endpoint_url,
        signing_key_env=signing_key_env,
        fields=StoreFields.argument("JOB"),
    )
    if store.root_missing():
        raise SpecError(
            f"{target} does not exist; give the job's checkpoint.uri with {{job}} filled in "
            "(e.g. ./spotline-runs/NAME/checkpoints), or the name of a running job"
        )
    if store.read_artifact(SUMMARY_ARTIFACT) is None and not store.committed_steps():
        raise SpecError(
            f"{store.uri} holds no Spotline job (no checkpoints, no artifacts/"
            f"{SUMMARY_ARTIFACT}); give the job's checkpoint.uri with {{job}} filled in, "
            "or the name of a running job"
        )
    return store


def summary_source(target: str | None, address: str):
    """A function returning the job's summary, from its controller or its checkpoints."""
    from spotline.checkpoint import SUMMARY_ARTIFACT
    from spotline.report import load_json

    found = _stored_or_live(target, address)
    if not isinstance(found, _Live):
        store = found

        def from_store() -> dict:
            summary = load_json(store.read_artifact(SUMMARY_ARTIFACT))
            if summary is None:
                raise SpecError(
                    f"{store.uri} holds checkpoints but no job summary (artifacts/"
                    f"{SUMMARY_ARTIFACT}); it is written at every commit by this version"
                )
            return summary

        return from_store
    import ray

    return lambda: ray.get(found.controller.summary.remote())


def read_trace(target: str, address: str, required: bool) -> dict | None:
    from spotline.checkpoint import TRACE_ARTIFACT
    from spotline.report import load_json

    found = _stored_or_live(target, address)
    if isinstance(found, _Live):
        import ray

        trace = ray.get(found.controller.trace.remote())
    else:
        trace = load_json(found.read_artifact(TRACE_ARTIFACT))
    if trace is None and required:
        raise SpecError(
            f"{target} has no pipeline trace: traces exist for jobs with "
            "parallel.pipeline_stages >= 2, written beside the checkpoints at every commit"
        )
    return trace


class _Live:
    """A running job's controller, as `_stored_or_live` found it."""

    def __init__(self, controller) -> None:
        self.controller = controller


def _stored_or_live(target: str | None, address: str):
    """The job `target` names: the store at a URI; a running job's controller (`_Live`);
    or, for a name no running controller answers to (or when no cluster answers), the
    store where that job last ran on this machine."""
    if target is not None and is_uri(target):
        return job_store(target)
    if target is None:
        return _Live(live_controller(running_job(address), address))
    try:
        return _Live(live_controller(target, address))
    except (SpecError, ConnectionError) as e:
        stored = last_run_store(target)
        if stored is None:
            raise e from None
        return stored


def last_run_store(name: str):
    """The store of the job `name` where it last ran on this machine, saying so on
    stderr; None when this machine has no record of it."""
    from spotline.job_index import last_run

    entry = last_run(name)
    if entry is None:
        return None
    uri = entry["checkpoint_uri"]
    when = f" (started {entry['started']})" if entry.get("started") else ""
    print(
        f"spotline: {name} is not running; reading it from where it last ran{when}: {uri}",
        file=sys.stderr,
    )
    return job_store(uri, entry.get("endpoint_url"), entry.get("signing_key_env"))
