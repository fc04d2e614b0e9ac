"""The per-job controller: a loop over states that carry their payload, and its rooms.

What lives here:
- `controller.py`: the loop and its transitions; it carries decisions out, and alone
  writes the job's `Record`.
- `state.py`: the states and their payloads; `clock.py`: the one clock every room reads.
- Parts the loop holds and drives: `fleet.py` (the processes: the live group, the ranks
  it hands on, replicas started ahead), `intake.py` (a poll of the group taken in),
  `departures.py` (leaving a group at a checkpoint, and the inbox's notices),
  `sizing.py` (how big the next group can be), `growth.py` (when growing pays; the
  one owner of the grow's state), `failures.py` (what a failure was), `door.py` (what
  other threads ask: they read only the published snapshot).
- Policies that return decisions, tested without Ray: `policies.py`, `notices.py`
  (just-in-time checkpoints), `repartition.py`, `recovery.py` (peer copies), `cordons.py`,
  `health.py` (hangs, stalls and stragglers from the ranks' heartbeats).
- Books and figures (`rooms.py` builds them): `pace.py`, `capacity.py`, `telemetry.py`,
  `snapshot.py` (the record, the snapshot and its projections: status, result,
  summary), `inbox.py`, `events.py`, `artifacts.py`, `backfill_api.py`.
- `actor.py`: the controller as a named Ray actor on the head node.

What it must never do: talk to storage except through the commit coordinator, make
the training step wait for it, block its loop on a group's start, read the time but
through its clock, or import spotline.backfill outside the actor (the pool is handed
in). Policies hold no Ray handles and do no I/O.
"""

from spotline.controller.controller import Controller
from spotline.controller.notices import JitPolicy
from spotline.controller.policies import (
    Fail,
    FailurePolicy,
    GrowPolicy,
    Resize,
    Restart,
    ScalingPolicy,
    Wait,
)
from spotline.controller.repartition import RebalancePolicy
from spotline.controller.snapshot import Attempt, Snapshot

__all__ = [
    "Attempt",
    "Controller",
    "Fail",
    "FailurePolicy",
    "GrowPolicy",
    "JitPolicy",
    "RebalancePolicy",
    "Resize",
    "Restart",
    "ScalingPolicy",
    "Snapshot",
    "Wait",
]
