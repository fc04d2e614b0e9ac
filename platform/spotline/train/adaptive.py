"""The adaptive global batch: the gradient noise scale, and the schedule it drives.

The simple noise scale B_simple = tr(Σ) / |G|² (McCandlish et al. 2018, "An Empirical
Model of Large-Batch Training", appendix A) is estimated from two squared gradient
norms the step already has: |G_small|², that of one micro-batch (B_small sequences,
read from the local gradient right after the step's first micro-batch backward,
before any reduction), and |G_big|², that of the whole step's gradient (B_big
sequences, the all-reduced norm DeepSpeed computes for clipping). For a batch of B,
E|G_B|² = |G|² + tr(Σ) / B, so two sizes give unbiased estimates of both:

    |G|²  ≈ (B_big |G_big|² - B_small |G_small|²) / (B_big - B_small)
    tr(Σ) ≈ (|G_small|² - |G_big|²) / (1 / B_small - 1 / B_big)

One step's estimates are very noisy: each is smoothed by an exponential moving
average, and B_simple is the ratio of the two averages (their bias corrections
cancel). Everything here is plain data and arithmetic: the schedule is a pure
function of the recorded history, which every checkpoint carries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class NoiseScale:
    """Exponential moving averages of the |G|² and tr(Σ) estimates of each step."""

    decay: float
    g2: float = 0.0
    """EMA of the |G|² estimates (uncorrected: it starts at 0)."""
    trace: float = 0.0
    """EMA of the tr(Σ) estimates."""
    count: int = 0
    """Steps folded in."""

    def update(self, small_sq: float, b_small: int, big_sq: float, b_big: int) -> None:
        """Fold in one step: squared gradient norms at batch sizes b_small < b_big."""
        if not b_small < b_big:
            return  # one micro-batch is the whole step: no second size to compare with
        if not (math.isfinite(small_sq) and math.isfinite(big_sq)):
            return  # an overflowed step says nothing about the noise
        g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
        trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
        d = self.decay
        self.g2 = d * self.g2 + (1.0 - d) * g2
        self.trace = d * self.trace + (1.0 - d) * trace
        self.count += 1

    def estimate(self) -> float | None:
        """B_simple in sequences, or None while the |G|² average is not positive."""
        if self.count == 0 or self.g2 <= 0.0:
            return None
        return self.trace / self.g2

    def to_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "g2": self.g2, "trace": self.trace, "count": self.count}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NoiseScale:
        return cls(float(d["decay"]), float(d["g2"]), float(d["trace"]), int(d["count"]))


def grow_to(current: int, estimate: float | None, unit: int, lo: int, hi: int) -> int:
    """The global batch after a checkpoint boundary: toward the noise scale, in whole
    units (micro-batches at every replica count), never shrinking, at most doubling
    per boundary (one noisy estimate cannot jump it to the bound), within [lo, hi]."""
    if estimate is None or estimate <= current:
        return max(lo, min(hi, current))
    target = unit * math.ceil(estimate / unit)
    return max(lo, min(hi, 2 * current, target))


@dataclass
class BatchSchedule:
    """The global batch in force at each step, and the noise scale that set it.

    history: [[first_step, global_batch], ...]: the batch of step k (1-based, as the
    trainer counts steps done) is that of the last entry whose first_step <= k.
    """

    schedule: str
    history: list[list[int]]
    noise: NoiseScale
    estimates: list[list[float]] = field(default_factory=list)
    """[[step, B_simple], ...] at each boundary where one was decided."""

    @classmethod
    def start(cls, batch: int, schedule: str, decay: float) -> BatchSchedule:
        return cls(schedule, [[1, batch]], NoiseScale(decay))

    @property
    def batch(self) -> int:
        """The global batch of the next step."""
        return self.history[-1][1]

    def batch_at(self, step: int) -> int:
        out = self.history[0][1]
        for first, size in self.history:
            if first <= step:
                out = size
        return out

    def set_from(self, step: int, batch: int) -> None:
        """Steps from `step` on train on `batch` sequences."""
        if batch != self.batch:
            self.history.append([step, batch])

    def lr_scale(self) -> float:
        """The square-root rule for Adam: lr x sqrt(B / B_start)."""
        return math.sqrt(self.batch / self.history[0][1])

    def to_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule,
            "history": [list(h) for h in self.history],
            "noise": self.noise.to_dict(),
            "estimates": [list(e) for e in self.estimates],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BatchSchedule:
        history = [[int(a), int(b)] for a, b in d["history"]]
        if not history:
            raise ValueError("batch schedule history is empty")
        est = [[int(s), float(b)] for s, b in d.get("estimates", [])]
        return cls(str(d["schedule"]), history, NoiseScale.from_dict(d["noise"]), est)


class GradProbe:
    """This rank's squared norm of the local gradient after the first micro-batch's
    backward of a step, read by post-accumulate hooks before any reduction: no extra
    backward pass, one small reduction over this rank's parameters per step.

    The engine scales every micro-batch's loss by 1 / gradient-accumulation steps, so
    the micro-batch's own squared norm is this times the square of that count.
    """

    def __init__(self, module: torch.nn.Module):
        self._armed = False
        self._seen: set[int] = set()
        self._sum: torch.Tensor | None = None
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook)
            for p in module.parameters()
            if p.requires_grad
        ]

    def _hook(self, p: torch.Tensor) -> None:
        if not self._armed or id(p) in self._seen or p.grad is None:
            return
        self._seen.add(id(p))
        sq = p.grad.detach().float().pow(2).sum()
        self._sum = sq if self._sum is None else self._sum + sq

    def arm(self) -> None:
        """Before a step: record the first gradient each parameter receives."""
        self._armed = True
        self._seen.clear()
        self._sum = None

    def take(self) -> float:
        """After the step: the recorded sum of squares (0.0 if nothing was recorded)."""
        self._armed = False
        out = 0.0 if self._sum is None else float(self._sum.item())
        self._sum = None
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
