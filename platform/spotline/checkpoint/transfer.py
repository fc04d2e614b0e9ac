"""Background serialization and upload of a rank's checkpoint shares.

One daemon thread per worker: it turns each snapshot (host copies the training step
made, the only part of a save that blocks training) into files under node-local
staging, uploads them (retried with backoff by the store), writes the rank's receipt,
and deletes the staged files. Saves of step N finish before those of step N+1 start.
`submit` only enqueues; results are collected as they finish (`take_done`), so a
step commits as soon as its last rank's upload is done. `build_manifest` turns every
rank's result of one step into the step's manifest (the commit coordinator's, and the
peer-memory offer's).
"""

from __future__ import annotations

import logging
import queue
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotline.checkpoint.layout import CheckpointFormatError, RankFiles
from spotline.checkpoint.manifest import FileEntry, Manifest, Receipt
from spotline.checkpoint.node_receipts import NodeReceipts
from spotline.checkpoint.reshard import combine_meta, shared_meta
from spotline.checkpoint.store import CheckpointStore

if TYPE_CHECKING:
    from spotline.config.schema import JobSpec

log = logging.getLogger("spotline.worker")


def attempt_dir(attempt: str) -> str:
    """Where a group's files of a step live: a re-save by another group never mixes."""
    return f"a-{attempt}"


def job_identity(spec: JobSpec) -> dict[str, Any]:
    """What a receipt and a manifest record of the job that wrote them: its name, spec
    hash and hashed fields with secrets masked (so a refusal can say what changed)."""
    return {"job": spec.name, "spec_hash": spec.spec_hash(), "spec": spec.recorded_fields()}


@dataclass
class UploadResult:
    step: int
    rank: int
    attempt: str = ""
    world_size: int = 0
    files: list[FileEntry] = field(default_factory=list)
    index: list[dict[str, Any]] = field(default_factory=list)
    """Where each saved tensor lies (file, byte range, sha256): what a restore reads."""
    seconds: float = 0.0
    """From the snapshot to the receipt: serialization and upload."""
    nbytes: int = 0
    error: str | None = None
    batch: dict[str, Any] | None = None
    """The adaptive batch schedule the rank saved (history and noise averages), if any:
    the manifest records it."""
    losses: list[tuple[int, float]] = field(default_factory=list)
    """(step, loss) of the steps trained since the rank's previous save (rank 0 only)."""
    meta: dict[str, Any] | None = None
    """What of the rank's meta every rank agrees on (`reshard.shared_meta`), if known."""

    @classmethod
    def from_receipt(cls, step: int, attempt: str, world: int, r: Any) -> UploadResult:
        """The result a rank's receipt (`manifest.Receipt`) read back from storage records."""
        losses = [(s, loss) for s, loss in r.losses]
        return cls(step, r.rank, attempt, world, r.files, r.index, batch=r.batch, losses=losses, meta=r.meta)  # fmt: skip


@dataclass
class _Job:
    step: int
    write: Callable[[Path], RankFiles] | None
    """Serializes the snapshot into a directory; returns its index entries and each
    file's size and sha256."""
    local: Path
    batch: dict[str, Any] | None = None
    losses: list[tuple[int, float]] = field(default_factory=list)
    upload: bool = True
    """False: a peer copy only (serialized and handed to `Uploader.peer`, never uploaded)."""


class Uploader:
    def __init__(
        self,
        store: CheckpointStore,
        spec: JobSpec,
        rank: int,
        world_size: int,
        attempt: str,
        max_bytes_per_s: float | None = None,
        node: NodeReceipts | None = None,
    ):
        self.store = store
        self.node = node
        """Where this rank's receipts meet its node's (`checkpoint.node_receipts`)."""
        self._node_said = False
        self.identity = job_identity(spec)
        self.rank = rank
        self.world_size = world_size
        self.attempt = attempt
        self.max_bytes_per_s = max_bytes_per_s
        self._todo: queue.Queue[_Job | None] = queue.Queue()
        self._done: list[UploadResult] = []
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self._saves = 0  # of them, checkpoint saves (not peer copies)
        self.peer: Callable[..., dict] | None = None
        """Called with each save's written files before they upload (peer memory keeps
        a copy: `spotline.runtime.peers.PeerSender`); what it returns is reported."""
        self._peer_done: list[dict[str, Any]] = []
        self._thread = threading.Thread(
            target=self._loop, name=f"spotline-upload-{rank}", daemon=True
        )
        self._thread.start()

    @property
    def busy(self) -> bool:
        """A save or copy is queued or in hand (a peer copy is then skipped)."""
        return not self._idle.is_set()

    @property
    def saving(self) -> bool:
        """A checkpoint save is queued or uploading: the next periodic save is skipped,
        so a rank holds at most one snapshot beyond the one being written."""
        with self._lock:
            return self._saves > 0

    def submit(
        self,
        step: int,
        local: Path,
        write: Callable[[Path], RankFiles],
        batch: dict[str, Any] | None = None,
        losses: list[tuple[int, float]] | None = None,
    ) -> None:
        """Serialize (`write(dir)`) and upload step `step`'s share in the background;
        `batch` (the adaptive batch schedule, if any) and `losses` (of the steps since
        the previous save) travel with its receipt."""
        with self._lock:
            self._pending += 1
            self._saves += 1
            self._idle.clear()
        self._todo.put(_Job(step, write, local, batch, list(losses or [])))

    def submit_peer(
        self,
        step: int,
        local: Path,
        write: Callable[[Path], RankFiles],
        batch: dict | None,
        losses: list[tuple[int, float]] | None = None,
    ) -> bool:
        """Serialize step `step`'s share for peer memory only, unless the thread is still
        busy with an earlier save (then this copy is skipped: False). Never uploaded.
        `losses`: (step, loss) the copy carries (rank 0's)."""
        with self._lock:
            if self._pending or self.peer is None:
                return False
            self._pending += 1
            self._idle.clear()
        self._todo.put(_Job(step, write, local, batch, list(losses or []), upload=False))
        return True

    def take_done(self) -> list[UploadResult]:
        with self._lock:
            out, self._done = self._done, []
        return out

    def take_peer_done(self) -> list[dict[str, Any]]:
        """What each peer copy since the last call did (`peer`'s reports)."""
        with self._lock:
            out, self._peer_done = self._peer_done, []
        return out

    def _send_peer(self, job: _Job, written: RankFiles, t0: float) -> None:
        if self.peer is None:
            return
        try:
            report = self.peer(job.step, job.local, written, job.batch, job.losses)
        except Exception as e:  # noqa: BLE001 - a lost peer copy never fails the save
            report = {"step": job.step, "error": f"{type(e).__name__}: {e}"}
        report["total_s"] = time.perf_counter() - t0  # serialization included
        report["ended"] = time.time()  # the controller reads the job's pace up to here
        report["with_save"] = job.upload  # a checkpoint's files, not a copy of its own
        with self._lock:
            self._peer_done.append(report)

    def _peer_only(self, job: _Job) -> None:
        t0 = time.perf_counter()
        try:
            shutil.rmtree(job.local, ignore_errors=True)
            job.local.mkdir(parents=True, exist_ok=True)
            written, job.write = job.write(job.local), None  # the snapshot goes here
            self._send_peer(job, written, t0)
        except Exception as e:  # noqa: BLE001 - reported; the next peer copy may land
            with self._lock:
                self._peer_done.append({"step": job.step, "error": f"{type(e).__name__}: {e}"})
        finally:
            shutil.rmtree(job.local, ignore_errors=True)
            with self._lock:
                self._pending -= 1
                if self._pending == 0:
                    self._idle.set()

    def close(self) -> None:
        """Stop once the job in hand is done; the saves and copies still queued are
        dropped (a rank leaving its group for a new one: they are the old group's
        steps, and a step commits only from every rank's receipt)."""
        with self._lock:
            while True:
                try:
                    job = self._todo.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    self._pending -= 1
                    self._saves -= job.upload
            if self._pending == 0:
                self._idle.set()
        self._todo.put(None)

    def wait(self, timeout_s: float) -> bool:
        """True once every submitted upload finished (or failed)."""
        return self._idle.wait(timeout_s)

    def _loop(self) -> None:
        while True:
            job = self._todo.get()
            if job is None:
                return
            if not job.upload:
                self._peer_only(job)
                continue
            t0 = time.perf_counter()
            prefix = f"{attempt_dir(self.attempt)}/rank_{self.rank:05d}"
            dropped = False
            try:
                shutil.rmtree(job.local, ignore_errors=True)
                job.local.mkdir(parents=True, exist_ok=True)
                # The host snapshot is dropped once written: uploads read the files.
                written, job.write = job.write(job.local), None
                self._send_peer(job, written, t0)
                index = written.entries
                files = self.store.upload_dir(
                    job.local,
                    job.step,
                    prefix=prefix,
                    max_bytes_per_s=self.max_bytes_per_s,
                    known=written.files,
                )
                for entry in index:
                    entry["file"] = f"{prefix}/{entry['file']}"
                meta = shared_meta(written.meta)
                receipt = self.store.write_receipt(
                    Receipt(
                        **self.identity,
                        step=job.step,
                        attempt=self.attempt,
                        rank=self.rank,
                        world_size=self.world_size,
                        files=files,
                        index=index,
                        batch=job.batch,
                        losses=[[s, loss] for s, loss in job.losses],
                        meta=meta,
                    )
                )
                # Left for the node's leader before the controller can know the step is
                # uploaded (and end the group): a copy on the local disk, never raises.
                dropped = self.node is not None and self.node.drop(job.step, receipt)
                result = UploadResult(
                    job.step,
                    self.rank,
                    self.attempt,
                    self.world_size,
                    files,
                    index,
                    time.perf_counter() - t0,
                    sum(f.size for f in files),
                    batch=job.batch,
                    losses=job.losses,
                    meta=meta,
                )
            except Exception as e:  # noqa: BLE001 - reported to the controller, never raised here
                result = UploadResult(
                    job.step,
                    self.rank,
                    self.attempt,
                    self.world_size,
                    seconds=time.perf_counter() - t0,
                    error=f"{type(e).__name__}: {e}",
                )
            finally:
                # Staging holds one save at a time per rank: never more than the next
                # restore could need, and nothing once it is in storage.
                shutil.rmtree(job.local, ignore_errors=True)
            with self._lock:
                self._done.append(result)
                self._pending -= 1
                self._saves -= 1
                if self._pending == 0:
                    self._idle.set()
            if result.error is None and dropped:
                self._gather(job.step, result.seconds)

    def _gather(self, step: int, took_s: float) -> None:
        """As the node's leader, write the node's receipts of `step` as one object
        (`checkpoint.node_receipts`). After the result is reported, so nothing waits for
        it; it gives way to the next save."""
        node = self.node
        assert node is not None
        if not node.leads():
            return
        bodies = node.gather(step, 2 * took_s, stop=lambda: not self._todo.empty())
        if not bodies:
            return
        try:
            self.store.write_node_receipts(step, self.attempt, self.rank, bodies)
        except Exception as e:  # noqa: BLE001 - a shortcut: each rank's own receipt stands
            if not self._node_said:
                self._node_said = True
                log.warning(
                    "rank %d could not write its node's upload receipts of step %d as one "
                    "object (%s); a commit from storage reads each rank's receipt instead",
                    self.rank,
                    step,
                    e,
                )


def build_manifest(
    spec: JobSpec,
    step: int,
    attempt: str,
    world: int,
    results: list[UploadResult],
    partition: list[int] | None = None,
) -> Manifest:
    """The manifest of `step` from every rank's upload result of group `attempt`, whose
    stages held the layers `partition` bounds (when known)."""
    replicas = world // spec.parallel.pipeline_stages
    # Every rank saved the same schedule (their metas must agree to load): rank 0's.
    ranked = sorted(results, key=lambda r: r.rank)
    schedule = next((r.batch for r in ranked if r.batch), None)
    batch = int(schedule["history"][-1][1]) if schedule else None
    files = sorted((f for r in results for f in r.files), key=lambda f: f.path)
    index = [e for r in ranked for e in r.index]
    identity = job_identity(spec)
    meta = _combined_meta(ranked)
    return Manifest(
        step=step,
        files=files,
        topology=spec.topology(replicas, batch),
        data_position={"next_step": step, "seed": spec.data.seed},
        spec_hash=identity["spec_hash"],
        created_at=time.time(),
        extra={
            "job": identity["job"],
            "attempt": attempt,
            "batch": spec.batch_record(replicas, schedule),
            "spec": identity["spec"],  # so a refused resume can say what differs
            "vocab_size": spec.vocab_size(),
            "index": index,
            **({"partition": list(partition)} if partition is not None else {}),
            **({"meta": meta} if meta is not None else {}),
        },
    )


def _combined_meta(ranked: list[UploadResult]) -> dict[str, Any] | None:
    """The checkpoint's meta from every rank's (`reshard.combine_meta`), when every rank
    reported its own; None otherwise (ranks of an older Spotline, or ranks that disagree:
    then a restore reads every rank's meta file and says what is wrong)."""
    if any(r.meta is None for r in ranked):
        return None
    try:
        return combine_meta([r.meta for r in ranked])
    except (CheckpointFormatError, KeyError, TypeError, AttributeError):
        return None
