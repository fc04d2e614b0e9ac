"""Which running job writes under a checkpoint root: one at a time.

Two jobs given one checkpoint.uri by mistake would commit over each other's steps and
expire each other's commits. The controller of a running job holds a lease on its root
(`artifacts/lease.json`: the job, its run, the Ray cluster and host it runs on, when it
started and when it last renewed the lease), renews it on a thread of its own, and
releases it when the job ends. A job that starts while another run holds a live lease
on its root fails before anything is written, naming the holder (`check_free`, from the
driver's preflight, and `LeaseKeeper.claim`, from the controller before its first
write).

A lease is live until it is released, or until it is `SPOTLINE_LEASE_TTL_S` past its
last renewal (its controller died with its node or was killed), or, on the same Ray
cluster, as soon as the holder's controller actor is gone. The check and the write are
two calls, so two jobs started within the same moment can both pass; the lease guards
against the mistake, not against an adversary (a signing key does that).

Never: block the controller's loop on storage (the renewal runs beside it), or hold
a root once its job has ended.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from spotline import constants
from spotline.checkpoint.errors import CheckpointMismatchError
from spotline.storage.errors import StorageError

LEASE_ARTIFACT = "lease.json"


@dataclass(frozen=True)
class Lease:
    job: str
    run: str
    cluster: str | None
    host: str
    started_at: float
    renewed_at: float
    released: bool = False


def read_lease(store: Any) -> Lease | None:
    """The lease on `store`'s root as stored; None when there is none or it does not
    parse (then it holds nothing)."""
    raw = store.read_artifact(LEASE_ARTIFACT)
    if raw is None:
        return None
    try:
        fields = json.loads(raw)
        return Lease(**{k: fields[k] for k in Lease.__dataclass_fields__ if k in fields})
    except (ValueError, TypeError, KeyError):
        return None


def holder(
    lease: Lease | None,
    now: float,
    run: str | None = None,
    cluster: str | None = None,
    alive: Callable[[str], bool] | None = None,
) -> Lease | None:
    """The run that holds `lease` against `run`, or None when the root is free for it:
    no lease, its own, released, expired, or (on the same cluster, where `alive` can
    tell) one whose controller is gone."""
    if lease is None or lease.released or lease.run == run:
        return None
    if now - lease.renewed_at > constants.SPOTLINE_LEASE_TTL_S:
        return None
    if alive is not None and cluster is not None and lease.cluster == cluster:
        return lease if alive(lease.job) else None
    return lease


def busy_message(store: Any, lease: Lease, now: float) -> str:
    where = f"on host {lease.host}" + (f", Ray cluster {lease.cluster}" if lease.cluster else "")
    return (
        f"{store.fields.uri} {store.uri} is in use by job {lease.job!r} ({where}, started "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(lease.started_at))}, last seen "
        f"{max(0.0, now - lease.renewed_at):.0f}s ago): two jobs writing one checkpoint.uri "
        "would expire each other's commits. Nothing was written there. Give this job its own "
        f"{store.fields.uri} (e.g. --set checkpoint.uri=...), or stop job {lease.job!r} first; "
        f"if it is no longer running, its lease lapses {constants.SPOTLINE_LEASE_TTL_S:.0f}s "
        "after it was last seen"
    )


def check_free(store: Any, job: str, now: float | None = None) -> None:
    """Preflight: CheckpointMismatchError when another job holds a live lease on the
    root. A lease of a job of the same name is left to its controller's `claim`, which
    can ask the cluster whether that run still lives (a rerun after a crash)."""
    now = time.time() if now is None else now
    try:
        lease = holder(read_lease(store), now)
    except StorageError:
        return  # the storage probe that follows says what is wrong with the storage
    if lease is not None and lease.job != job:
        raise CheckpointMismatchError(busy_message(store, lease, now))


class LeaseKeeper:
    """A controller's lease on its checkpoint root: `claim` once before the job's first
    write, renewed on a thread of its own until `release`."""

    def __init__(
        self,
        store: Any,
        job: str,
        event: Callable[..., None],
        wall: Callable[[], float] = time.time,
    ):
        self.store, self.job, self._event, self.wall = store, job, event, wall
        self.run = uuid.uuid4().hex
        self.cluster: str | None = None
        """The Ray cluster this controller runs on (its GCS address), when known."""
        self.alive: Callable[[str], bool] | None = None
        """Whether the controller of a job runs on this cluster, when it can be asked."""
        self._lease: Lease | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def claim(self) -> None:
        """Take the root's lease, or CheckpointMismatchError naming the run that holds it;
        then keep it renewed."""
        now = self.wall()
        alive = self.alive
        if alive is not None:  # one controller a job name on a cluster: this one
            alive = lambda job, ask=alive: job != self.job and ask(job)  # noqa: E731
        theirs = holder(read_lease(self.store), now, self.run, self.cluster, alive)
        if theirs is not None:
            raise CheckpointMismatchError(busy_message(self.store, theirs, now))
        self._lease = Lease(self.job, self.run, self.cluster, socket.gethostname(), now, now)
        self._write(self._lease)
        self._thread = threading.Thread(
            target=self._renew, name="spotline-checkpoint-lease", daemon=True
        )
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(constants.SPOTLINE_LEASE_RENEW_S):
            lease = self._lease
            if lease is not None:
                self._write(Lease(**{**asdict(lease), "renewed_at": self.wall()}))

    def _write(self, lease: Lease) -> bool:
        try:
            self.store.write_artifact(LEASE_ARTIFACT, json.dumps(asdict(lease)).encode())
        except StorageError as e:
            if not self._failing:  # said once, and once more when it recovers
                self._event(
                    f"could not renew this job's lease on {self.store.uri} ({e}); another job "
                    "started on the same checkpoint.uri would not be refused while it fails",
                    logging.WARNING,
                )
            self._failing = True
            return False
        if self._failing:
            self._event(f"this job's lease on {self.store.uri} is renewed again")
        self._failing = False
        return True

    def release(self) -> None:
        """The job has ended: stop renewing, and free the root at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        lease, self._lease = self._lease, None
        if lease is not None:
            self._write(Lease(**{**asdict(lease), "renewed_at": self.wall(), "released": True}))
