"""Taking in a poll of the live group: the loop's one door from the ranks.

`Intake.poll` collects what the ranks published and hands each part to its room:
steps and figures to telemetry, heartbeats to the health book, saves and finished
uploads to the commit coordinator (a commit then goes to the record, the trackers,
backfill and the artifacts), notices to the inbox, peer copies to peer recovery.
Then the hang watch: a group with no step past its bound is torn down as a failure
naming the ranks that hold it up, with their stacks taken first. It runs on the
loop's thread and writes the record only as the loop's hand.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from spotline import constants
from spotline.bubbles.book import BubbleBook
from spotline.checkpoint.coordinator import CommitCoordinator, Committed
from spotline.config.schema import JobSpec
from spotline.controller.artifacts import Artifacts
from spotline.controller.backfill_api import BackfillAPI
from spotline.controller.clock import Clock
from spotline.controller.fleet import Fleet
from spotline.controller.health import Hang, HealthBook
from spotline.controller.notices import JitBook
from spotline.controller.recovery import PeerRecovery
from spotline.controller.repartition import PartitionBook
from spotline.controller.snapshot import Record
from spotline.controller.telemetry import Telemetry
from spotline.heap import collection_held
from spotline.runtime.progress import Backfill, Progress, Stacks, WorkerFailure, WorkerGroup
from spotline.runtime.stacks import summarise

_KEEPING_UP = 3
"""Checkpoints in a row, none skipped, before skipped ones are said to be over."""


class Intake:
    def __init__(
        self,
        spec: JobSpec,
        rec: Record,
        *,
        fleet: Fleet,
        telemetry: Telemetry,
        health: HealthBook,
        coordinator: CommitCoordinator,
        recovery: PeerRecovery,
        jit: JitBook,
        partitions: PartitionBook,
        artifacts: Artifacts,
        backfill: Backfill | None,
        backfill_api: BackfillAPI,
        bubbles: BubbleBook | None,
        stacks: Stacks | None,
        notify: Callable[[dict[str, Any]], bool],
        write_artifacts: Callable[[], None],
        event: Callable[..., None],
        clock: Clock,
    ):
        self.spec, self.rec, self.fleet, self.telemetry = spec, rec, fleet, telemetry
        self.health, self.coordinator, self.recovery = health, coordinator, recovery
        self.jit, self.partitions, self.artifacts = jit, partitions, artifacts
        self.backfill, self.backfill_api, self.bubbles = backfill, backfill_api, bubbles
        self.stacks, self.notify, self.write_artifacts = stacks, notify, write_artifacts
        self._event, self.clock = event, clock
        self.step = 0
        """The latest step the live group reported (its restored step once it started)."""

    @property
    def group(self) -> WorkerGroup:
        group = self.fleet.group
        assert group is not None
        return group

    def poll(self) -> Progress:
        """One collection of the ranks' progress: losses, saves, commits, figures; then
        the hang watch. The group holds automatic collection back only while it builds
        the snapshot (`spotline.heap`): the wait for the ranks, the commits' writes to
        storage and the keepers' calls run with it on."""
        clock, health = self.clock, self.health
        t0 = clock()
        progress = self.group.poll(constants.SPOTLINE_POLL_INTERVAL_S)
        self.take(progress, clock() - t0)
        fig = self.telemetry.fig
        hang = health.hang(clock(), list(fig.step_seconds), fig.blocked_s)
        if hang is not None:
            # Torn down now, not after failure.collective_timeout_s: the ranks holding
            # the others up are named, with the phase each was last seen in (a data
            # stall past its limit: the ranks waiting for data), and a hang's stacks
            # are taken first, while the stuck ranks are as they were.
            error = hang.error()
            ranks = [b.rank for b in hang.behind]
            if isinstance(hang, Hang):
                self._take_evidence(ranks)
            nodes = {b.rank: b.node for b in hang.behind}
            raise WorkerFailure("training", {str(error): ranks}, nodes, [error])
        return progress

    def take(self, p: Progress, elapsed: float) -> None:
        """A poll of the live group: its figures to telemetry, its saves and finished
        uploads to the commit coordinator, its notices to the inbox. What the books make
        of thousands of ranks' reports is a burst of containers, taken with automatic
        collection held (`spotline.heap`); then what may wait (a commit's writes to
        storage, the trackers' figures, backfill's calls, the keepers' calls) runs with
        it on."""
        group, rec = self.group, self.rec
        now = self.clock()
        with collection_held():
            if p.steps:
                self.step = p.steps[-1][0]
            attempt = rec.attempts[-1]
            rec.take_losses(attempt.attempt, [(s, loss) for s, loss, _, _ in p.steps])
            self.telemetry.take_steps(p, group.replicas, now)
            self.health.take(p.ranks, self.step, now)
            for step in sorted(p.saves):
                self.coordinator.expect(step, group.attempt, group.world_size)
            self._saves_skipped(p.skipped_saves, sorted(p.saves))
            self.telemetry.take_memory(p, group.replicas)
        for done in self.coordinator.receive(p.uploads):
            self.committed(done)
        for notice in p.notices:
            self.notify(notice)
        self.telemetry.account(
            p, elapsed, group, now, self.bubbles, self.backfill, self.partitions, attempt.start_step
        )
        self.export_counts()
        self.recovery.take(p.peer, group, p.steps)

    def export_counts(self) -> None:
        self.telemetry.export_counts(
            self.backfill_api.finished_counts(), self.rec, len(self.jit.notices)
        )

    def committed(self, done: Committed) -> None:
        """A commit: its losses into the record, its figures out, backfill's turn."""
        self.rec.take_losses(done.manifest.extra.get("attempt"), done.losses)
        self.telemetry.commit(done.step, done.nbytes, done.upload_s)
        if done.upload_s is not None and self.fleet.group is not None:
            self.jit.check_fit(self.fleet.group.replicas)  # once, from the first measured save
        if self.backfill is not None:
            self.backfill.on_commit(done.manifest, final=done.step >= self.spec.train.steps)
            self.backfill.poll()  # start what is due now
        self.write_artifacts()

    def _saves_skipped(self, skipped: list[int], saved: list[int]) -> None:
        """Say once when periodic checkpoints start being skipped (uploads slower than
        the interval), and once when they keep up again: three checkpoints in a row
        with none skipped between them."""
        f = self.telemetry.fig
        for step, was_skipped in sorted([(s, True) for s in skipped] + [(s, False) for s in saved]):
            if was_skipped:
                f.skipped_saves.append(step)
                f.saves_in_a_row = 0
                if not f.saves_behind:
                    f.saves_behind = True
                    self._event(
                        f"checkpoint at step {step} skipped: a rank was still uploading an "
                        "earlier one (uploads take longer than checkpoint.interval_steps = "
                        f"{self.spec.checkpoint.interval_steps} steps of training). Raise "
                        "checkpoint.interval_steps, or lift checkpoint.upload_max_mb_per_s",
                        logging.WARNING,
                    )
                continue
            f.saves_in_a_row += 1
            if f.saves_behind and f.saves_in_a_row >= _KEEPING_UP:
                f.saves_behind = False
                self._event(
                    f"checkpoints keep up again at step {step} ({len(f.skipped_saves)} "
                    "skipped so far)"
                )

    def _take_evidence(self, named: list[int]) -> None:
        """The stacks of the hung group's ranks (every rank of a group of at most
        SPOTLINE_STACKS_ALL_RANKS, else the named ones), and on NCCL their flight
        records, stored beside the checkpoints and summarised for status. Bounded by
        SPOTLINE_STACKS_TIMEOUT_S; it never fails the hang path."""
        group = self.group
        if self.stacks is None:
            return
        every = group.world_size <= constants.SPOTLINE_STACKS_ALL_RANKS
        try:
            record = self.stacks.take(group, None if every else named)
        except Exception as e:  # noqa: BLE001 - evidence is best effort
            self._event(f"could not take the hung ranks' stacks: {e}", logging.WARNING)
            return
        record.update(step=self.step, attempt=group.attempt, named=named)
        uri = self.artifacts.store_stacks(f"hang-{group.attempt}-step{self.step}", record)
        summary = {
            "why": "hang",
            "step": self.step,
            "attempt": group.attempt,
            "taken_at": record.get("taken_at"),
            "uri": uri,
            "ranks": summarise(record, named),
        }
        self.health.took_stacks(summary)
        where = "; ".join(
            f"rank {k}: {s['frame'] or s['error']}" + (f" ({s['state']})" if s["state"] else "")
            for k, s in summary["ranks"].items()
        )
        kept = f"; the stacks taken are at {uri}" if uri else ""
        self._event(f"stacks taken before the teardown: {where}{kept}", logging.WARNING)
