"""What other threads ask of a running job: the controller's door.

The controller's actor answers `status`, `result`, `summary`, `trace` and `stacks`
calls, and takes notices, stop and re-partition requests, on threads of its own while
the loop runs on another. The door reads only what the loop published (`Published`:
a snapshot after each step, a trace when one is asked for) and the event log, and it
writes only into the inbox (and the coordinator's holds, under its lock): it never
touches the loop's state.
"""

from __future__ import annotations

from typing import Any

from spotline.checkpoint.coordinator import CommitCoordinator
from spotline.config.schema import JobSpec
from spotline.controller.clock import Clock
from spotline.controller.events import Events
from spotline.controller.fleet import Fleet
from spotline.controller.inbox import Inbox
from spotline.controller.snapshot import Published, as_result, as_status, as_summary
from spotline.runtime.progress import Stacks


class Door:
    def __init__(
        self,
        spec: JobSpec,
        published: Published,
        events: Events,
        inbox: Inbox,
        coordinator: CommitCoordinator,
        fleet: Fleet,
        stacks: Stacks | None,
        clock: Clock,
    ):
        self.spec, self.published, self.events, self.inbox = spec, published, events, inbox
        self.coordinator, self.fleet, self.stacks, self.clock = coordinator, fleet, stacks, clock

    def status(self, since_event: int = 0) -> dict[str, Any]:
        """The published snapshot and the events since `since_event`. Any thread."""
        return as_status(self.published.snapshot(), *self.events.since(since_event))

    def result(self) -> dict[str, Any]:
        return as_result(self.published.snapshot())

    def summary(self) -> dict[str, Any]:
        """What `spotline status` and `spotline report` show (stored with the checkpoints)."""
        return as_summary(self.published.snapshot())

    def trace(self) -> dict[str, Any] | None:
        return self.published.trace(timeout_s=5.0)

    def take_stacks(self) -> dict[str, Any]:
        """Every rank's stack now (`spotline stacks`). Any thread: it reads the live
        group's worker list (its Ray handles and where each rank runs), nothing else."""
        group, snap = self.fleet.group, self.published.snapshot()
        if group is None or self.stacks is None:
            return {
                "job": self.spec.name,
                "error": f"job {self.spec.name} has no group running to take stacks of (it is "
                f"{snap.state}); try again once it trains",
            }
        record = self.stacks.take(group, None)
        record.update(step=snap.step, attempt=group.attempt, job=self.spec.name)
        return record

    def notify(self, notice: dict[str, Any]) -> bool:
        """A preemption notice (Notice fields); True once accepted. Any thread: node
        watchers call it at any time, and re-send until it returns True."""
        return self.inbox.notify(notice, self.clock(), self.clock.wall())

    def request_repartition(self, sizes: list[int]) -> None:
        """Re-partition the pipeline to `sizes` layers per stage at the next checkpoint
        boundary (through the checkpoint, as the imbalance watch does). Any thread."""
        self.inbox.repartition(list(sizes))

    def hold_latest(self, seconds: float = 900.0) -> dict[str, Any] | None:
        """Keep the newest committed step from retention for `seconds`, for a reader
        outside the job; {"step", "uri"}, or None when nothing is committed. Any thread."""
        step = self.coordinator.hold_latest(seconds)
        return None if step is None else {"step": step, "uri": self.coordinator.store.uri}

    def request_stop(self, reason: str = "stop requested") -> None:
        """Stop at the next step boundary, commit a checkpoint there, and end STOPPED.
        Any thread. The job resumes from that checkpoint when it is submitted again."""
        self.inbox.stop(reason)
