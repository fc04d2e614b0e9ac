"""The job's backfill pool as the SDK reaches it: submit a task, read its record.

The pool itself (spotline.backfill) runs the tasks in the pipeline's bubbles; this is
only the door the controller actor opens to it, and the way its results reach the
job's figures. It never imports spotline.backfill: the pool is handed in.
"""

from __future__ import annotations

from typing import Any


class BackfillAPI:
    def __init__(self, pool, telemetry):
        self.pool = pool  # a spotline.backfill.pool.BackfillPool, or None: backfill is off
        self.telemetry = telemetry

    def on_result(self, result: dict[str, Any]) -> None:
        """A task's result, for the trackers and metrics (the pool calls it)."""
        self.telemetry.backfill_result(result)

    def submit(self, task: Any, name: str | None = None) -> int:
        if self.pool is None:
            raise RuntimeError(
                "backfill is off for this job; set backfill.enabled: true (it needs "
                "parallel.pipeline_stages >= 2) to run backfill tasks"
            )
        return self.pool.submit(task, name)

    def record(self, task_id: int) -> dict[str, Any] | None:
        return self.pool.record(task_id) if self.pool is not None else None

    def finished_counts(self) -> dict[str, int]:
        """Tasks done and failed so far, by state."""
        tasks: dict[str, int] = {}
        for t in self.pool.results() if self.pool is not None else []:
            if t["state"] in ("done", "failed"):
                tasks[t["state"]] = tasks.get(t["state"], 0) + 1
        return tasks
