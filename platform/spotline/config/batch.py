"""The batch policy of a job: how the global batch, the micro-batches and the learning
rate follow the replica count, and what a checkpoint records of them.

`BatchPolicy` is mixed into `JobSpec`: its methods read only the spec's parallel,
elastic, train and deepspeed sections, and change nothing. The controller, the
workers, the planner and the checkpoint manifests all take their batch arithmetic
from here, so every part of a job agrees on it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from spotline.config.sections import ElasticSpec, ParallelSpec, TrainSpec

ABSENT = object()
"""What `dig` returns for a key that is not there (None may be a value)."""


def dig(d: Any, path: list[str]) -> Any:
    """The value at `path` in nested dicts, or `ABSENT`."""
    for part in path:
        if not isinstance(d, dict) or part not in d:
            return ABSENT
        d = d[part]
    return d


class BatchPolicy:
    """The batch and elastic arithmetic of a `JobSpec` (mixed into it)."""

    if TYPE_CHECKING:  # the sections it reads, declared by JobSpec
        parallel: ParallelSpec
        elastic: ElasticSpec
        train: TrainSpec
        deepspeed: dict[str, Any]

    def _check_batch(self) -> None:
        """The batch fields' cross-checks: a whole number of micro-batches per replica at
        every replica count the job runs at, and the adaptive schedule's bounds."""
        e = self.elastic
        b, m = self.train.global_batch_size, self.parallel.micro_batches
        slots = m * e.max_replicas  # micro-batches per step at max_replicas
        if b % slots != 0:
            raise ValueError(
                f"train.global_batch_size ({b}) must be divisible by parallel.micro_batches x "
                f"elastic.max_replicas ({m} x {e.max_replicas} = {slots}): that is the number "
                f"of micro-batches of one step at full size; set global_batch_size to a "
                f"multiple of {slots}"
            )
        if e.batch_policy == "constant" and slots % e.min_replicas:
            raise ValueError(
                f"with elastic.batch_policy 'constant', elastic.min_replicas "
                f"({e.min_replicas}) must divide parallel.micro_batches x "
                f"elastic.max_replicas ({slots}), so a group of min_replicas runs a whole "
                f"number of micro-batches per replica; the job runs at the replica counts "
                f"that divide {slots}. Set min_replicas to one of "
                f"{[d for d in range(1, e.max_replicas + 1) if slots % d == 0]}, or use "
                "batch_policy 'scaled'"
            )
        if self.train.batch_schedule == "adaptive":
            self._check_adaptive()

    def _check_adaptive(self) -> None:
        e, p, a = self.elastic, self.parallel, self.train.adaptive
        if e.batch_policy != "constant":
            raise ValueError(
                "train.batch_schedule 'adaptive' needs elastic.batch_policy 'constant' (got "
                f"{e.batch_policy!r}): the schedule, not the replica count, sets the batch; "
                "set batch_policy: constant, or batch_schedule: fixed"
            )
        if p.zero_stage != 1:
            raise ValueError(
                f"train.batch_schedule 'adaptive' needs parallel.zero_stage: 1 (got "
                f"{p.zero_stage}): the noise scale reads each rank's gradient after its first "
                "micro-batch, before ZeRO reduces it; set zero_stage: 1, or batch_schedule: fixed"
            )
        if dig(self.deepspeed, ["zero_optimization", "overlap_comm"]) is True:
            raise ValueError(
                "deepspeed.zero_optimization.overlap_comm cannot be true with "
                "train.batch_schedule 'adaptive': it reduces gradients during the backward, "
                "before the noise scale reads them; remove the key, or use batch_schedule: fixed"
            )
        if a.max_batch_size is None:
            raise ValueError(
                "train.adaptive.max_batch_size is required with train.batch_schedule "
                "'adaptive'; set it to the largest global batch (sequences) the job may grow to"
            )
        unit = self.batch_unit()
        lo, hi = self.batch_bounds()
        for name, v in (("min_batch_size", lo), ("max_batch_size", hi)):
            if v % unit:
                raise ValueError(
                    f"train.adaptive.{name} ({v}) must be a multiple of {unit} (micro-batch "
                    f"size {self.micro_batch_size()} x {unit // self.micro_batch_size()} "
                    f"micro-batches, which every replica count in {self.replica_counts()} "
                    f"divides); set it to {max(unit, v - v % unit)} or {v - v % unit + unit}"
                )
        if lo > hi:
            raise ValueError(
                f"train.adaptive.min_batch_size ({lo}) must be <= train.adaptive."
                f"max_batch_size ({hi}); raise max_batch_size or lower min_batch_size"
            )

    def micro_batch_size(self) -> int:
        """Sequences per micro-batch per replica: fixed at every replica count."""
        return self.train.global_batch_size // (
            self.parallel.micro_batches * self.elastic.max_replicas
        )

    def replica_counts(self) -> list[int]:
        """Replica counts the job runs at: under the constant batch policy, those in
        [min, max] that divide micro_batches x max_replicas (each replica then runs a
        whole number of micro-batches); every count in [min, max] when scaled."""
        e = self.elastic
        span = range(e.min_replicas, e.max_replicas + 1)
        if e.batch_policy == "scaled":
            return list(span)
        slots = self.parallel.micro_batches * e.max_replicas
        return [d for d in span if slots % d == 0]

    def grad_accum(self, replicas: int) -> int:
        """Micro-batches per step per replica (the 1F1B depth when pipelined; at the
        start of an adaptive schedule)."""
        m = self.parallel.micro_batches
        if self.train.batch_schedule == "adaptive":
            return self.micro_batches_for(self.batch_bounds()[0], replicas)
        if self.elastic.batch_policy == "scaled":
            return m
        return m * self.elastic.max_replicas // replicas

    def global_batch(self, replicas: int) -> int:
        """Sequences per optimizer step with `replicas` replicas (at the start of an
        adaptive schedule)."""
        if self.train.batch_schedule == "adaptive":
            return self.batch_bounds()[0]
        return self.micro_batch_size() * self.grad_accum(replicas) * replicas

    def batch_unit(self) -> int:
        """The step of an adaptive batch: micro-batch size x the least number of
        micro-batches every allowed replica count divides, so the batch in force runs
        whole micro-batches per replica at any of them."""
        return self.micro_batch_size() * math.lcm(*self.replica_counts())

    def batch_bounds(self) -> tuple[int, int]:
        """[min, max] sequences per step of the adaptive schedule (fixed: both the
        configured batch)."""
        a, b = self.train.adaptive, self.train.global_batch_size
        if self.train.batch_schedule != "adaptive":
            return b, b
        return (a.min_batch_size or b), (a.max_batch_size or b)

    def micro_batches_for(self, batch: int, replicas: int) -> int:
        """Micro-batches per step per replica that make a global batch of `batch`."""
        per = self.micro_batch_size() * replicas
        if batch % per:
            raise ValueError(
                f"a global batch of {batch} is not a whole number of micro-batches of "
                f"{self.micro_batch_size()} over {replicas} replica(s)"
            )
        return batch // per

    def lr_scale(self, replicas: int) -> float:
        """Learning-rate multiplier: 1, or sqrt(D / max_replicas) for the scaled policy."""
        if self.elastic.batch_policy == "scaled":
            return math.sqrt(replicas / self.elastic.max_replicas)
        return 1.0

    def topology(self, replicas: int, batch: int | None = None) -> dict[str, Any]:
        """The layout a checkpoint records, and a resume compares against (`batch`: the
        adaptive schedule's global batch in force, if any)."""
        p = self.parallel
        micro = (
            self.grad_accum(replicas) if batch is None else self.micro_batches_for(batch, replicas)
        )
        return {
            "pipeline_stages": p.pipeline_stages,
            "replicas": replicas,
            "world_size": p.pipeline_stages * replicas,
            "zero_stage": p.zero_stage,
            "micro_batches": micro,
            "micro_batch_size": self.micro_batch_size(),
            "precision": p.precision,
        }

    def batch_record(self, replicas: int, schedule: dict[str, Any] | None = None) -> dict[str, Any]:
        """The batch policy in force at `replicas`, as every manifest records it;
        `schedule` is the adaptive schedule's record (`BatchSchedule.to_dict`) when the
        job has one: its history then sets the batch."""
        rule = (
            "global batch constant; micro-batches per step = m x max_replicas / D"
            if self.elastic.batch_policy == "constant"
            else "global batch = global_batch_size x D / max_replicas; lr x sqrt(D / max_replicas)"
        )
        out = {
            "policy": self.elastic.batch_policy,
            "schedule": self.train.batch_schedule,
            "rule": rule,
            "global_batch_size": self.global_batch(replicas),
            "micro_batch_size": self.micro_batch_size(),
            "micro_batches_per_step": self.grad_accum(replicas),
            "lr_scale": self.lr_scale(replicas),
        }
        if schedule is not None:
            batch = int(schedule["history"][-1][1])
            start = int(schedule["history"][0][1])
            out.update(
                rule="global batch grows toward the gradient noise scale at checkpoint "
                "boundaries, in whole micro-batches within train.adaptive's bounds; "
                "lr x sqrt(batch / min_batch_size)",
                global_batch_size=batch,
                micro_batches_per_step=self.micro_batches_for(batch, replicas),
                lr_scale=math.sqrt(batch / start),
                history=schedule["history"],
                noise=schedule["noise"],
                estimates=schedule.get("estimates", []),
            )
        return out
