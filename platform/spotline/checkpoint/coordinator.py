"""The commit coordinator: the one owner of receipts -> manifest -> retention -> quarantine
-> restore.

- A step commits when every rank of ONE group (attempt) has written its receipt; the
  manifest lists exactly that group's files (they live under the attempt's own prefix,
  so a re-save by another group can never mix with them). It is written last, and
  commits the moment the last upload finishes: each rank reported its uploads done, and
  a finished upload is whole in storage (an S3 PUT is atomic and strongly consistent; a
  file:// upload is fsynced). Its files are checked against a listing of storage
  afterwards, before retention deletes anything (`retain`): a step that fails the
  check is quarantined and nothing older goes. A step committed from receipts found in
  storage (`commit_from_storage`) is checked before its manifest is written.
- A step counts as committed only while its manifest verifies (`catalog.list_steps`),
  for retention, commit-from-storage, restore and a finished job alike. A damaged one
  (planted, truncated, unsigned) is quarantined once a good step proves the key right,
  and never deletes anything.
- A restore goes through one fallback path: an unparsable or unsigned manifest, a
  missing file or a sha256 mismatch falls back to the previous committed step and says
  so; a load error that is not corruption is retried a bounded number of times, then
  falls back too (`loading.py`, which also refuses a step this spec must not resume).
  Once an older step loaded, each step that failed verification is quarantined: kept
  for inspection, never read again, never counted by keep_last.
- Receipts read back from storage commit only when they verify (signed, when a key is
  set) and were written by this job under this spec.
- Retention (checkpoint.keep_last, `retention.py`) runs after commits, keeping the steps
  readers pin or hold.
- A storage error in a commit, in retention or in an artifact write is reported and
  retried later; it never reaches the workers, so it never tears down a healthy group.

The controller talks to storage only through this class.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from spotline.checkpoint.catalog import Steps
from spotline.checkpoint.errors import CorruptCheckpointError
from spotline.checkpoint.lease import LeaseKeeper
from spotline.checkpoint.loading import Event, Restorable, StepLoader
from spotline.checkpoint.manifest import Manifest
from spotline.checkpoint.retention import apply_retention
from spotline.checkpoint.store import (
    LEDGER_ARTIFACT,
    MANIFEST_NAME,
    SUMMARY_ARTIFACT,
    CheckpointStore,
)
from spotline.checkpoint.transfer import UploadResult, attempt_dir, build_manifest
from spotline.config.identity import mismatch_reason, written_by_this
from spotline.config.schema import JobSpec
from spotline.storage.errors import StorageError

RETAIN_RETRY_S = 30.0
HOLDS_ARTIFACT = "holds.json"
"""Committed steps held from retention for readers outside the job: step -> until (epoch s)."""


@dataclass
class _Pending:
    attempt: str
    world: int
    results: dict[int, UploadResult] = field(default_factory=dict)


@dataclass
class Committed:
    step: int
    nbytes: int
    files: int
    upload_s: float | None
    committed_at: float
    manifest: Manifest
    losses: list[tuple[int, float]] = field(default_factory=list)
    """(step, loss) the committing group's receipts carried: the steps since its
    previous save, which a group that died before reporting them would otherwise lose."""


class CommitCoordinator:
    def __init__(
        self,
        spec: JobSpec,
        store: CheckpointStore,
        event: Event,
        load_retries: int = 2,
        wall: Callable[[], float] = time.time,
    ):
        self.spec, self.store, self._event = spec, store.of_job(spec, records_checks=True), event
        self.loader = StepLoader(spec, store, event, load_retries)
        self.lease = LeaseKeeper(store, spec.name, event, wall)
        self.wall = wall  # the controller's wall clock: holds and commit stamps
        self.committed: list[int] = []
        self._pending: dict[tuple[int, str], _Pending] = {}
        self._retention_due = False
        self._retain_after = 0.0  # a pass that left held steps: the next one not before
        self.partitions: dict[str, list[int]] = {}
        """Per group (attempt): the layer bounds of its stages, recorded in its manifests."""
        self.pinned: Callable[[], Iterable[int]] = tuple
        """The committed steps a reader (a backfill task) still uses: retention keeps them."""
        self._holds: dict[int, float] = {}  # step held for a reader outside the job -> until
        self.quarantined: list[int] = []
        """Steps set aside after they failed verification: never restored, never counted."""
        self._refused: set[tuple[int, str]] = set()  # uploads found in storage, refused
        self._holds_lock = threading.Lock()
        self._recovered: list[Committed] = []  # committed from storage by restore()
        self._unchecked: dict[int, Manifest] = {}  # committed, files not listed yet (`retain`)

    def take_recovered(self) -> list[Committed]:
        """The steps the last restores committed from receipts found in storage, once."""
        out, self._recovered = self._recovered, []
        return out

    # --- saves and receipts -----------------------------------------------------------

    def expect(self, step: int, attempt: str, world: int) -> None:
        """Group `attempt` (of `world` ranks) saved `step`: its uploads will follow."""
        self._pending.setdefault((step, attempt), _Pending(attempt, world))

    def pending_steps(self) -> list[int]:
        return sorted({s for s, _ in self._pending})

    def abandon(self, attempt: str) -> None:
        """The group died: its saves that are not all uploaded never commit."""
        for key in [k for k in self._pending if k[1] == attempt]:
            self._pending.pop(key)

    def receive(self, results: list[UploadResult]) -> list[Committed]:
        """Fold in finished uploads; commit every step whose group is now complete. The
        caller runs `retain` next, once it has taken the commits."""
        out = []
        for r in results:
            p = self._pending.get((r.step, r.attempt))
            if p is None:
                continue
            if r.error:
                self._event(
                    f"checkpoint step {r.step} abandoned: rank {r.rank} upload failed after "
                    f"retries: {r.error}",
                    logging.WARNING,
                )
                self._pending.pop((r.step, r.attempt))
                continue
            p.results[r.rank] = r
            if len(p.results) == p.world:
                self._pending.pop((r.step, r.attempt))
                done = self._commit(
                    r.step, p.attempt, p.world, list(p.results.values()), check=False
                )
                if done is not None:
                    out.append(done)
        return out

    def commit_from_storage(self, steps: Steps | None = None) -> list[Committed]:
        """Commit steps newer than the latest commit whose every rank of one group left a
        receipt in storage (their completion reports died with the group). Only receipts
        this job wrote under this spec commit: an unsigned or badly signed one (when
        checkpoint.signing_key_env is set), another job's, or one of another spec (a
        resubmission with other data, seed or batch) is refused, and the step with it.
        `steps`: the listing of the steps just taken, when the caller has one."""
        out = []
        try:
            # Verified commits only: a damaged manifest at a high step hides nothing.
            steps = self.store.list_steps() if steps is None else steps
            latest = max(steps.committed, default=-1)
            for step in steps.uncommitted:
                if step <= latest:
                    continue
                scan = self.store.read_receipts(step)
                who = f"if no run of this job wrote it, check who can write to {self.store.uri}"
                for why in scan.refusals():
                    self._refuse(step, why, who)
                if scan.bypassed:  # each of their ranks' own receipts stands in
                    self._event(f"step {step}: {scan.bypassed_line()}; {who}", logging.WARNING)
                for attempt, receipts in sorted(scan.receipts.items()):
                    theirs = next(
                        (
                            r
                            for r in receipts
                            if not written_by_this(self.spec, r.job, r.spec_hash, r.spec)
                        ),
                        None,
                    )
                    if theirs is not None:
                        why = mismatch_reason(self.spec, theirs.job, theirs.spec_hash, theirs.spec)
                        self._refuse(
                            step,
                            f"the receipts of group {attempt}: one {why}",
                            "to keep that step instead, resubmit the job and spec that wrote it",
                        )
                        continue
                    world = receipts[0].world_size
                    ranks = sorted(r.rank for r in receipts)
                    if ranks != list(range(world)) or any(r.world_size != world for r in receipts):
                        continue
                    results = [UploadResult.from_receipt(step, attempt, world, r) for r in receipts]
                    self._event(
                        f"step {step}: every rank of group {attempt} had uploaded; committing it"
                    )
                    done = self._commit(step, attempt, world, results, check=True)
                    if done is not None:
                        out.append(done)
                        break
        except StorageError as e:
            self._event(f"could not look for finished uploads: {e}", logging.WARNING)
        return out

    def _refuse(self, step: int, why: str, fix: str) -> None:
        """Say once (per controller) that uploads found in storage do not commit."""
        if (step, why) in self._refused:
            return
        self._refused.add((step, why))
        self._event(
            f"checkpoint step {step} at {self.store.step_uri(step)} is not committed: {why}. "
            f"The job goes on from its latest commit; {fix}",
            logging.WARNING,
        )

    def _commit(
        self, step: int, attempt: str, world: int, results: list[UploadResult], check: bool
    ) -> Committed | None:
        """Write the manifest of `attempt`'s `step`; `check`: list its files first (else
        `retain` does, before it deletes anything)."""
        manifest = build_manifest(
            self.spec, step, attempt, world, results, self.partitions.get(attempt)
        )
        try:
            self.store.commit(manifest, check)
        except (StorageError, CorruptCheckpointError) as e:
            # Training goes on; the next checkpoint commits in its place.
            self._event(f"checkpoint step {step} not committed: {e}", logging.WARNING)
            return None
        if not check:
            self._unchecked[step] = manifest
        self.committed = sorted(set(self.committed) | {step})
        self.quarantined = [s for s in self.quarantined if s != step]  # saved again since
        self._retention_due = True
        self._retain_after = 0.0
        self._sweep_other_attempts(step, attempt)
        upload_s = max((r.seconds for r in results), default=0.0) or None
        self._event(
            f"committed checkpoint step {step} ({manifest.total_bytes / 1e6:.1f} MB, "
            f"{len(manifest.files)} files) -> {self.store.step_uri(step)}"
        )
        losses = sorted({s: loss for r in results for s, loss in r.losses}.items())
        return Committed(
            step,
            manifest.total_bytes,
            len(manifest.files),
            upload_s,
            self.wall(),
            manifest,
            losses,
        )

    def _sweep_other_attempts(self, step: int, keep: str) -> None:
        """Files of other groups under a committed step (a re-save that died) go; not
        where the step was quarantined before (its files are kept for inspection)."""
        try:
            if self.store.holds_quarantine_record(step):
                return
            for attempt in self.store.receipt_attempts(step):
                if attempt != keep:
                    self.store.remove(step, attempt_dir(attempt))
        except StorageError as e:
            self._event(f"could not sweep step {step}'s abandoned uploads: {e}", logging.WARNING)

    def retain(self) -> None:
        """Check the files of the steps committed since, then apply checkpoint.keep_last,
        keeping pinned steps; a storage error is reported and retried later, and so is a
        pinned step past keep_last once it is released."""
        now = self.wall()
        if not self._retention_due or now < self._retain_after:
            return
        with self._holds_lock:
            self._holds = {s: t for s, t in self._holds.items() if t > now}
            pinned = set(self.pinned()) | set(self._holds)
        try:
            steps = self.store.list_steps()
            if steps.committed:  # a good step shows the key is right: the damaged go aside
                self._quarantine([(s, MANIFEST_NAME, why) for s, why in steps.damaged.items()])
            if self._check_committed(steps.committed):
                steps = self.store.list_steps()
            if self._unchecked:  # a step lacks a file and could not be set aside
                self._retain_after = now + RETAIN_RETRY_S
                return
            deleted = apply_retention(self.store, self.spec.checkpoint.keep_last, pinned, steps)
        except StorageError as e:
            self._event(f"retention deferred: {e}", logging.WARNING)
            return
        self.committed = [s for s in self.committed if s not in deleted]
        held = self.committed[: -self.spec.checkpoint.keep_last]
        self._retention_due = bool(held)
        # Held steps are looked at again at the next commit, or in a while (not at every
        # poll: each pass lists the storage).
        self._retain_after = now + RETAIN_RETRY_S if held else 0.0

    def _check_committed(self, committed: list[int]) -> bool:
        """List the files of each step committed without a check; quarantine one that
        lacks a file, so that retention counts it as nothing. Whether one was. A step
        whose quarantine record could not be written stays unchecked: nothing is deleted
        while it does."""
        self._unchecked = {s: m for s, m in self._unchecked.items() if s in committed}
        failed = False
        for step, manifest in sorted(self._unchecked.items()):
            bad = self.store.bad_files(manifest)
            if not bad:
                self.store.mark_checked(step)  # a restarted controller need not list them
                del self._unchecked[step]
                continue
            path, reason = bad[0]
            more = f" (and {len(bad) - 1} more of its files)" if len(bad) > 1 else ""
            self._quarantine(
                [(step, path, reason)],
                said=f"quarantined checkpoint step {step}, and deleted nothing older for it: "
                f"its manifest names {path}, which {reason}{more}, though the rank that wrote "
                f"it reported the upload done (look for whatever else deletes from "
                f"{self.store.uri})",
            )
            if step in self.quarantined:
                del self._unchecked[step]
                failed = True
        return failed

    def hold_latest(self, seconds: float) -> int | None:
        """Keep the newest committed step whose files were listed present past keep_last
        for `seconds`, for a reader outside this job (a sweep trial that will continue
        from it); the step, or None when there is none. Safe to call from any thread."""
        unchecked = self._unchecked.copy()  # one call: the loop's thread may change it
        with self._holds_lock:
            # Only a step whose files were listed: one committed on its ranks' word alone
            # may yet be quarantined by the check that follows it.
            checked = [s for s in self.committed if s not in unchecked]
            if not checked:
                return None
            step = checked[-1]
            self._holds[step] = max(self._holds.get(step, 0.0), self.wall() + seconds)
            self._retention_due = True  # retained away once the hold ends
            holds = dict(self._holds)
        # Stored, so that a restarted controller of this job keeps them too.
        self.write_artifact(HOLDS_ARTIFACT, json.dumps(holds).encode())
        return step

    def _load_holds(self) -> None:
        raw = self.read_artifact(HOLDS_ARTIFACT)
        try:
            stored = {int(k): float(v) for k, v in json.loads(raw).items()} if raw else {}
        except (ValueError, AttributeError, TypeError):
            stored = {}  # unreadable: it only delays retention, never loads anything
        now = self.wall()
        with self._holds_lock:
            self._holds.update({k: v for k, v in stored.items() if v > now})

    # --- restore --------------------------------------------------------------------

    def recorded_partition(self) -> list[int] | None:
        """The stage bounds the newest committed checkpoint was trained at, when it has
        the job's number of stages (a resume keeps them); None otherwise."""
        try:
            steps = self.store.committed_steps()
            if not steps:
                return None
            m = self.store.load_manifest(max(steps))
        except (StorageError, CorruptCheckpointError, FileNotFoundError):
            return None  # the restore that follows reports what is wrong
        bounds = m.extra.get("partition")
        same = m.topology.get("pipeline_stages") == self.spec.parallel.pipeline_stages
        return list(bounds) if same and isinstance(bounds, list) else None

    def check_owner(self) -> None:
        """Refuse a root that holds only other jobs' checkpoints, or one another running
        job holds (CheckpointMismatchError); then hold it until `close`."""
        self.store.check_owner(self.spec)
        self.lease.claim()

    def close(self) -> None:
        """The job has ended: its root is free for the next run."""
        self.lease.release()

    def has_checkpoint(self) -> bool:
        """Whether `restore` has a step to load: a committed step of this job, or
        checkpoint.resume_from. A group that restores one need not initialise weights."""
        return self.spec.checkpoint.resume_from is not None or bool(self.store.committed_steps())

    def restore(
        self, group: Restorable, sleep: Callable[[float], None], peer: Any = None
    ) -> tuple[int, Manifest | None]:
        """Load the newest committed step that verifies into `group`: (step, manifest), or
        (0, None) when nothing is committed. CorruptCheckpointError when every step fails.

        `peer` (a `spotline.checkpoint.peer.PeerOffer`): a step the failed group left
        complete in live peers' memory. When it is at least as new as the newest commit
        it loads from there (nothing read from storage); when any rank cannot read or
        verify it, the restore falls back to the commits and says so."""
        listing = self.store.list_steps()
        recovered = self.commit_from_storage(listing)
        if recovered:  # listed again: a step it committed is a step to restore
            self._recovered += recovered
            listing = self.store.list_steps()
        self._load_holds()
        self.committed = list(listing.committed)
        self.quarantined = list(listing.quarantined)
        good = listing.committed
        if peer is not None and peer.step >= (good[-1] if good else 0):
            try:
                return self.loader.load(group, peer.manifest, sleep, "peer"), peer.manifest
            except CorruptCheckpointError as e:
                newest = f"the newest commit (step {good[-1]})" if good else "the start"
                self._event(
                    f"peer copy of step {peer.step} could not be restored ({e.path}: "
                    f"{e.reason}); restoring from {newest} instead",
                    logging.WARNING,
                )
        # Damaged manifests are tried in turn too, so that each one newer than the step
        # that loads is said where the restore falls back past it.
        damaged = listing.damaged
        steps = sorted([*good, *damaged], reverse=True)
        if not steps and self.spec.checkpoint.resume_from is not None:
            return self._restore_resume_from(group, sleep)
        failed: list[tuple[int, str, str]] = []
        for i, step in enumerate(steps):
            older = steps[i + 1] if i + 1 < len(steps) else None
            then = f"falling back to step {older}" if older is not None else "no older step to try"
            try:
                if step in damaged:
                    raise CorruptCheckpointError(
                        step, MANIFEST_NAME, damaged[step], uri=self.store.uri
                    )
                manifest = self.store.load_manifest(step)
                self.loader.check_compatible(manifest)
                restored = self.loader.load(group, manifest, sleep)
            except CorruptCheckpointError as e:
                self._event(
                    f"checkpoint step {step} at {self.store.uri} failed verification "
                    f"({e.path}: {e.reason}); {then}",
                    logging.WARNING,
                )
                failed.append((step, e.path, e.reason))
                continue
            except FileNotFoundError:  # deleted by retention between listing and reading
                self._event(f"checkpoint step {step} was deleted while restoring; {then}")
                continue
            # Only once an older step loaded: when every step fails, the cause may be
            # the job's own (a wrong signing key), and the steps must stay as they are.
            # Damaged manifests older than it go too: they would never load either.
            self._quarantine(
                failed + [(s, MANIFEST_NAME, why) for s, why in damaged.items() if s < step]
            )
            return restored, manifest
        if steps:
            raise CorruptCheckpointError(
                steps[-1],
                "*",
                "every committed step failed verification",
                uri=self.store.uri,
                message=f"every committed checkpoint at {self.store.uri} failed verification "
                f"(steps {sorted(steps)}); refusing to start from scratch over them. Inspect or "
                "move them, or point checkpoint.uri at an empty location.",
            )
        return 0, None

    def _quarantine(self, failed: list[tuple[int, str, str]], said: str = "") -> None:
        """Set aside the steps that failed verification, so that no later restore reads
        them first and keep_last never counts them in place of good steps. `said`: the
        start of the line, when the caller says which step and what is wrong."""
        for step, path, reason in failed:
            try:
                record = self.store.quarantine(step, path, reason)
            except StorageError as e:
                self._event(
                    f"could not quarantine checkpoint step {step} ({e}); the next commit or "
                    "restore tries again",
                    logging.WARNING,
                )
                continue
            self.committed = [s for s in self.committed if s != step]
            self.quarantined = sorted(set(self.quarantined) | {step})
            what = said or f"quarantined checkpoint step {step} ({path}: {reason})"
            self._event(
                f"{what}: no restore reads it "
                f"again and checkpoint.keep_last does not count it. Its files stay at "
                f"{self.store.step_uri(step)} for inspection ({record} says what failed); "
                "delete that folder once you are done with it",
                logging.WARNING,
            )

    def _restore_resume_from(
        self, group: Restorable, sleep: Callable[[float], None]
    ) -> tuple[int, Manifest]:
        """Load checkpoint.resume_from's step (this job has committed nothing yet). There is
        no fallback: the spec names what to start from, so a missing or corrupt step
        fails the start (CorruptCheckpointError)."""
        source_spec = self.spec.checkpoint.resume_from
        assert source_spec is not None
        source = self.store.sibling(source_spec.uri)
        step = source_spec.step or max(source.committed_steps(), default=0)
        try:
            if not step:
                raise FileNotFoundError(source.uri)
            manifest = source.load_manifest(step)
            self.loader.check_compatible(manifest, source)
            restored = self.loader.load(group, manifest, sleep, source.uri)
        except FileNotFoundError:
            raise CorruptCheckpointError(
                step,
                "*",
                "not committed",
                uri=source.uri,
                message=f"checkpoint.resume_from: {source.uri} holds no committed step "
                f"{step or '(none at all)'} (deleted by its job's retention, or never "
                "committed); name a committed step, or remove checkpoint.resume_from",
            ) from None
        self._event(
            f"started from checkpoint step {manifest.step} of {source.uri} "
            f"(checkpoint.resume_from, job {manifest.extra.get('job')!r})"
        )
        return restored, manifest

    # --- artifacts --------------------------------------------------------------------

    def write_artifact(self, relpath: str, data: bytes) -> str | None:
        try:
            return self.store.write_artifact(relpath, data)
        except StorageError as e:
            self._event(f"could not write {relpath} beside the checkpoints: {e}", logging.WARNING)
            return None

    def read_artifact(self, relpath: str) -> bytes | None:
        with contextlib.suppress(StorageError):  # unreadable: as if not there
            return self.store.read_artifact(relpath)
        return None

    def finished_summary(self) -> dict[str, Any] | None:
        """The summary this job stored when it finished, if nothing is left to train: its
        last step is still the newest commit, its manifest verifies, its files are all in
        storage (listed now), and it reaches train.steps; said either way. None otherwise (never finished, trained on since,
        train.steps raised to train further, or the final step damaged: then it is said
        and quarantined, and the job trains again from the newest good commit)."""
        raw = self.read_artifact(SUMMARY_ARTIFACT)
        try:
            saved = json.loads(raw) if raw is not None else None
        except ValueError:
            return None
        if not isinstance(saved, dict) or saved.get("state") != "finished":
            return None
        steps = self.store.list_steps()
        good = steps.committed
        final = (saved.get("committed_steps") or [None])[-1]
        why = steps.damaged.get(final) if isinstance(final, int) else None
        if why and good and final > good[-1] and final >= self.spec.train.steps:
            # Set aside here, so that the restore that follows starts from the newest good
            # commit without a word. With no good step, that restore refuses, saying why.
            self._quarantine(
                [(final, MANIFEST_NAME, why)],
                said=f"job {self.spec.name} already finished at step {final}, but that "
                f"checkpoint failed verification ({MANIFEST_NAME}: {why}); training steps "
                f"{good[-1] + 1}..{final} again from step {good[-1]}. Step {final} is quarantined",
            )
            return None
        if not good or good[-1] < self.spec.train.steps or final != good[-1]:
            return None
        # Its files too, listed now, not only its manifest: a report of a finished job
        # over files that are gone would hand an export nothing to load.
        bad = self.store.bad_files(self.store.load_manifest(final))
        if bad:
            path, reason = bad[0]
            since = f"step {good[-2]}" if len(good) > 1 else "the start"
            self._quarantine(
                [(final, path, reason)],
                said=f"job {self.spec.name} already finished at step {final}, but that "
                f"checkpoint's {path} {reason}; training again from {since}. Step {final} "
                "is quarantined",
            )
            return None
        self._event(
            f"job {self.spec.name} already finished at step {final}; reporting it from its "
            "stored summary. Raise train.steps to train further, or set checkpoint.uri for a "
            "fresh run"
        )
        return saved

    def store_summary(self, summary: dict[str, Any], ledger: dict[str, Any]) -> None:
        self.write_artifact(LEDGER_ARTIFACT, json.dumps(ledger).encode())
        self.write_artifact(SUMMARY_ARTIFACT, json.dumps(summary, default=str).encode())
