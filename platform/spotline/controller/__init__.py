"""The per-job controller: a loop over states that carry their payload, and its rooms.

What lives here:
- `controller.py`: the loop and its transitions; it carries decisions out.
- `state.py`: the states and their payloads.
- `policies.py`, `jit.py`, `repartition.py`, `recovery.py`, `cordons.py`: policies
  that return decisions (restart or fail, how many replicas, when to grow, at which
  step to take a just-in-time checkpoint, when to re-partition the pipeline, every how
  many steps to take peer copies and which copy to restore, which node to cordon, when
  a cordon expires or gives way to min_replicas, and when to leave it), tested
  without Ray.
- `health.py`: hang bounds, data stalls and stragglers read from the ranks'
  heartbeats, and the summaries of the stacks taken at hangs.
- `pace.py`, `capacity.py`: the measured pace the decisions weigh; patient reads of
  the cluster's capacity and losses.
- `telemetry.py`: progress ingest, the goodput ledger, metrics and trackers.
- `snapshot.py`: the job's typed record and snapshot; status, result and summary are
  projections of it.
- `inbox.py`: what other threads tell the controller, under a lock, and its events.
- `artifacts.py`, `backfill_api.py`: what the job keeps beside its checkpoints (hang
  stacks included); the backfill pool's door for the SDK.
- `actor.py`: the controller as a named Ray actor on the head node.

What it must never do: talk to storage except through the commit coordinator, make
the training step wait for it, or import spotline.backfill outside the actor (the
pool is handed in). Policies hold no Ray handles and do no I/O.
"""

from spotline.controller.controller import Controller
from spotline.controller.jit import JitPolicy
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
