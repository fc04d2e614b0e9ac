"""What the 1F1B schedule says about idle time, before anything is measured.

DeepSpeed's `TrainSchedule` gives each stage 2(m+p-1) slots per step, and in
2(p-1) of them the stage has no forward or backward to run: with equal slot
times that is the bubble fraction (p-1)/(m+p-1). Which physical moments a stage
waits in depends on its neighbours, so `simulate` plays every stage's real
instruction stream against the others (sends are eager, a receive blocks until
the matching send finished) and returns the timeline each stage would record,
instruction for instruction: the schedule, then the loss broadcast (LossSync)
and the all-rank agreement (StepSync) that `StepRecorder` records after it.

It is the detector's oracle in tests, `spotline plan`'s step time, and the
recorder's cold-start prediction: until a stage has measured a step, the
windows it tells its backfill executor about are `simulate_passes`' at the
stages' estimated costs.
"""

from __future__ import annotations

from dataclasses import dataclass

COMPUTE = frozenset({"ForwardPass", "BackwardPass", "LoadMicroBatch", "OptimizerStep"})
"""Instructions that keep the device busy."""
PASSES = frozenset({"ForwardPass", "BackwardPass"})
"""The stage's own layers, forward and backward: no collective, no transfer, no data."""
COMM = frozenset({"ReduceGrads", "ReduceTiedGrads"})
"""Data-parallel gradient collectives: real communication work, not a bubble."""
WAITS = frozenset(
    {"RecvActivation", "RecvGrad", "SendActivation", "SendGrad", "LossSync", "StepSync"}
)
"""Instructions in which a stage blocks on another stage: where bubbles are spent.
LossSync is DeepSpeed's loss broadcast from the last stage after the schedule;
StepSync is Spotline's per-step agreement of all ranks (one tiny all-reduce)."""


@dataclass(frozen=True)
class Instr:
    """One executed instruction of a stage's step, times relative to the step's start."""

    name: str
    slot: int
    """Slot of TrainSchedule it belongs to (-1 for what runs after the schedule)."""
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


def theory_fraction(stages: int, micro_batches: int) -> float:
    """(p-1)/(m+p-1): each stage's idle share of a 1F1B step with equal slot times."""
    return (stages - 1) / (micro_batches + stages - 1)


def program(stages: int, micro_batches: int, stage: int) -> list[tuple[int, str]]:
    """(slot, instruction name) in the order DeepSpeed executes them on `stage`."""
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    sched = TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage)
    return [(slot, type(cmd).__name__) for slot, cmds in enumerate(sched.steps()) for cmd in cmds]


def idle_slots(stages: int, micro_batches: int, stage: int) -> list[int]:
    """Slots of the schedule in which `stage` has no forward or backward to run."""
    busy = {slot for slot, name in program(stages, micro_batches, stage) if name in _PASSES}
    return [s for s in range(2 * (micro_batches + stages - 1)) if s not in busy]


_PASSES = frozenset({"ForwardPass", "BackwardPass"})


def simulate(
    stages: int,
    micro_batches: int,
    t_fwd: float | list[float] = 1.0,
    t_bwd: float | list[float] = 1.0,
    t_comm: float = 0.0,
) -> list[list[Instr]]:
    """Each stage's timeline of one step; per-stage costs may be lists (one per stage).

    After the schedule, the last stage broadcasts the loss (LossSync: the sender does not
    wait, a receiver waits until the last stage is done), then the all-stage StepSync
    ends the step, so every timeline ends at the same time.
    """
    p = stages
    fwd = t_fwd if isinstance(t_fwd, list) else [t_fwd] * p
    bwd = t_bwd if isinstance(t_bwd, list) else [t_bwd] * p
    progs = [program(p, micro_batches, s) for s in range(p)]
    clock = [0.0] * p
    pc = [0] * p
    out: list[list[Instr]] = [[] for _ in range(p)]
    # FIFO channels: activations s -> s+1 and gradients s+1 -> s, holding arrival times.
    acts: list[list[float]] = [[] for _ in range(p)]  # acts[s]: into stage s
    grads: list[list[float]] = [[] for _ in range(p)]  # grads[s]: into stage s

    def cost(s: int, name: str) -> float:
        return {"ForwardPass": fwd[s], "BackwardPass": bwd[s]}.get(name, 0.0)

    progress = True
    while progress:
        progress = False
        for s in range(p):
            while pc[s] < len(progs[s]):
                slot, name = progs[s][pc[s]]
                start = clock[s]
                if name in ("RecvActivation", "RecvGrad"):
                    queue = acts[s] if name == "RecvActivation" else grads[s]
                    if not queue:
                        break  # blocked until the neighbour sends
                    end = max(start, queue.pop(0)) + t_comm
                elif name == "SendActivation":
                    end = start + t_comm
                    acts[s + 1].append(end)
                elif name == "SendGrad":
                    end = start + t_comm
                    grads[s - 1].append(end)
                else:
                    end = start + cost(s, name)
                out[s].append(Instr(name, slot, start, end))
                clock[s] = end
                pc[s] += 1
                progress = True
    if any(pc[s] < len(progs[s]) for s in range(p)):
        raise RuntimeError("pipeline schedule deadlocked in simulation")  # cannot happen
    loss_sent = clock[p - 1]
    finish = max(clock)
    for s in range(p):
        sent = max(clock[s], loss_sent)
        out[s].append(Instr("LossSync", -1, clock[s], sent))
        out[s].append(Instr("StepSync", -1, sent, finish))
    return out


def simulate_passes(stages: int, micro_batches: int, micro_s: list[float]) -> list[list[Instr]]:
    """`simulate` with stage s spending micro_s[s] seconds on the forward and backward of
    one micro-batch, the backward twice the forward (the FLOP convention: 3x forward)."""
    return simulate(
        stages,
        micro_batches,
        t_fwd=[t / 3 for t in micro_s],
        t_bwd=[2 * t / 3 for t in micro_s],
    )


def compute_gaps(timeline: list[Instr]) -> list[tuple[float, float]]:
    """Stretches of a step in which the stage ran neither compute nor a collective."""
    gaps = []
    t = 0.0
    for ins in timeline:
        if ins.name not in WAITS and ins.seconds > 0:
            if ins.start > t:
                gaps.append((t, ins.start))
            t = max(t, ins.end)
    end = timeline[-1].end if timeline else 0.0
    if end > t:
        gaps.append((t, end))
    return gaps
