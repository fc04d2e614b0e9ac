"""The `failure` section of a job spec: how many restarts a job may use, and how the
controller finds ranks that hang or straggle and keeps bad nodes out.

A hang (no rank's step advances) is found from the ranks' heartbeats, within
`hang_factor` x the median step time (at least SPOTLINE_HANG_FLOOR_S); the
torch.distributed timeout (`collective_timeout_s`) is only the backstop behind it.
A rank waiting for its step's batches is waiting on storage, not hung: that is a data
stall, reported and never counted against the node. A straggler is a rank whose own
compute per step is slower than its peers' by more than `straggler_threshold` over
`straggler_window_steps` steps. Hangs on a node count for `hang_count_ttl_s`, and a
cordon lasts `cordon_ttl_s`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class FailureSpec(BaseModel):
    """What the controller does when workers die, hang or straggle."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    max_failures: int = Field(3, ge=-1)
    """Restarts allowed before the job fails; -1 means unlimited. Hangs count; nodes lost
    to spot preemption do not."""
    hang_factor: float = Field(10.0, gt=1.0)
    """A hang is declared when no rank's step advanced for this many median steps (plus
    the longest measured save), and at least SPOTLINE_HANG_FLOOR_S seconds."""
    collective_timeout_s: float = Field(600.0, gt=0.0)
    """torch.distributed's timeout of one collective or rendezvous wait: the backstop
    behind hang detection. When it fires, the rank's error reaches the controller as a
    hang."""
    straggler_threshold: float = Field(0.2, gt=0.0)
    """A rank whose own compute per step is this much slower than its peers' (0.2: 20%)
    over a window, and stays so for more than another window, is reported as a
    straggler; it is reported well again once it stayed below half of this for more
    than a window (no report flapping around the threshold)."""
    straggler_window_steps: int = Field(20, ge=2)
    """Steps a rank's compute time is compared over."""
    cordon: bool = True
    """Keep bad nodes out of new groups for the rest of the job: a node whose rank hung
    `cordon_after_hangs` times, or straggled past `cordon_straggler_threshold`. Only
    when the job can still run at elastic.min_replicas without it."""
    cordon_after_hangs: int = Field(2, ge=1)
    """Hangs of a rank on the same node, within `hang_count_ttl_s`, before that node is
    cordoned."""
    hang_count_ttl_s: float = Field(3600.0, gt=0.0)
    """How long a hang counts against its node (default 1 h): two hangs on a node within
    an hour cordon it; a hang a day does not."""
    cordon_ttl_s: float = Field(21600.0, gt=0.0)
    """How long a cordon lasts (default 6 h), in this controller and in a resubmitted
    job; then new groups may use the node again (a node that hangs again is cordoned
    again). A cordon is lifted earlier, oldest first and with an event, when the job
    could not otherwise reach elastic.min_replicas."""
    cordon_straggler_threshold: float = Field(0.5, gt=0.0)
    """A straggler this much slower than its peers (0.5: 50%) gets its node cordoned;
    the job restarts without it at the next checkpoint boundary when that pays."""
    test_faults: bool = False
    """Tests and benchmarks only: this job applies the faults the SPOTLINE_TEST_FAULTS
    directory names for it (frozen or slowed ranks, `spotline.runtime.faults`). A job
    without it never applies them, whatever the environment says."""

    @model_validator(mode="after")
    def _thresholds(self) -> FailureSpec:
        if self.cordon_straggler_threshold < self.straggler_threshold:
            raise ValueError(
                f"failure.cordon_straggler_threshold ({self.cordon_straggler_threshold}) is "
                f"below failure.straggler_threshold ({self.straggler_threshold}); a node is "
                "cordoned only for a worse slowdown than the one that is reported: raise it"
            )
        return self
