"""The goodput ledger: where every device-second of a job went.

The controller charges each iteration of its state machine to one part, for the
devices the job holds at that moment (its group's world size; while it waits
below min_replicas, the devices of the group it lost, which the job keeps paying
for on the nodes that are left):

    useful            training steps that count (the compute share of each step)
    data_stall        steps waiting for their batches (what prefetching did not hide)
    bubble_filled     pipeline bubble time a backfill executor worked in
    bubble_unfilled   pipeline bubble time left idle
    checkpoint_stall  saves that blocked training
    recovery          restarts: placement, rendezvous, restore (and resizes)
    recomputed        steps trained again because a fault threw them away
    waiting           below elastic.min_replicas, waiting for capacity
    startup_other     the first start, the final evaluation, controller time between chunks

A training chunk splits into useful and bubble by the stages' own measurements;
steps lost to a fault move from useful to recomputed when the job resumes
behind them. The parts always add up to `total` (every charge goes to exactly
one part), and the ledger is stored with the checkpoints, so a restarted
controller continues the same account.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PARTS = (
    "useful",
    "data_stall",
    "bubble_filled",
    "bubble_unfilled",
    "checkpoint_stall",
    "recovery",
    "recomputed",
    "waiting",
    "startup_other",
)
# What the same steps would have used on on-demand capacity: no faults, no waiting.
ON_DEMAND_PARTS = (
    "useful",
    "data_stall",
    "bubble_filled",
    "bubble_unfilled",
    "checkpoint_stall",
    "startup_other",
)


@dataclass
class GoodputLedger:
    device_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    total_s: float = 0.0
    steps: int = 0  # steps whose compute is in `useful`

    def charge(self, part: str, seconds: float, devices: int) -> None:
        if part not in self.device_s:
            raise KeyError(f"unknown ledger part {part!r}; parts: {', '.join(PARTS)}")
        amount = max(0.0, seconds) * devices
        self.device_s[part] += amount
        self.total_s += amount

    def train(
        self,
        seconds: float,
        devices: int,
        steps: int,
        bubble_fraction: float = 0.0,
        fill_fraction: float = 0.0,
        data_stall_s: float = 0.0,
    ) -> None:
        """A chunk of `steps` training steps that took `seconds` on `devices`, of which
        `data_stall_s` waiting for batches; the rest splits into compute and bubble."""
        stall = min(max(data_stall_s, 0.0), max(seconds, 0.0))
        rest = seconds - stall
        b = min(max(bubble_fraction, 0.0), 1.0)
        f = min(max(fill_fraction, 0.0), 1.0)
        self.charge("data_stall", stall, devices)
        self.charge("useful", rest * (1 - b), devices)
        self.charge("bubble_filled", rest * b * f, devices)
        self.charge("bubble_unfilled", rest * b * (1 - f), devices)
        self.steps += steps

    def lost(self, steps: int) -> None:
        """`steps` trained steps were thrown away: their compute becomes recomputed work."""
        if steps <= 0 or self.steps <= 0:
            return
        per_step = self.device_s["useful"] / self.steps
        moved = min(self.device_s["useful"], per_step * steps)
        self.device_s["useful"] -= moved
        self.device_s["recomputed"] += moved
        self.steps -= min(steps, self.steps)

    def goodput(self) -> float:
        return self.device_s["useful"] / self.total_s if self.total_s else 0.0

    def cost(self, spot_per_hour: float | None, on_demand_per_hour: float | None) -> dict:
        """Dollars: this job on spot, and its same steps on on-demand capacity."""
        out: dict[str, float | None] = {"spot": None, "on_demand_same_steps": None}
        if spot_per_hour is not None:
            out["spot"] = self.total_s / 3600 * spot_per_hour
        if on_demand_per_hour is not None:
            used = sum(self.device_s[p] for p in ON_DEMAND_PARTS)
            out["on_demand_same_steps"] = used / 3600 * on_demand_per_hour
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"device_s": dict(self.device_s), "total_s": self.total_s, "steps": self.steps}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GoodputLedger:
        parts = dict.fromkeys(PARTS, 0.0) | {k: float(v) for k, v in d["device_s"].items()}
        return cls(parts, float(d["total_s"]), int(d.get("steps", 0)))
