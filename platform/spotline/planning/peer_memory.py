"""Peer memory predicted from the spec: what one node's state keeper holds, and how the
job degrades when that does not fit the node's budget.

A rank's peer copy is exactly what its checkpoint holds (`planning.checkpoint_time` sizes the
busiest one): its ZeRO share of its stage's fp32 master weights and Adam moments, and
on replica 0 the stage's 16-bit weights. A node's keeper holds the copies of the node's
own ranks and of the ranks on the node before it in the ring (its buddies), each for
`steps` steps: the newest complete one and the one arriving (2), or just one. The node
holds the copy arriving twice (its room in the keeper, its bytes in Ray's object store
until the keeper has them), and around a restore the step restored from stays pinned
until the new group's first copy has settled. The figure is the most over every
replica count the job runs at, since a node's share grows as nodes go.

The levels, in the order a job degrades through them when the budget is short:
two kept steps with buddies, one kept step with buddies, one kept step on the rank's
own node only (a lost node loses its ranks' copies), none. `fit_level` picks the
first whose bytes fit. The state keepers apply the same
levels to the real placement; `spotline plan` prints them for the job's shape.

Pure arithmetic: nothing allocated, nothing started.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from spotline import constants
from spotline.config.schema import JobSpec
from spotline.models import layer_tensor_sizes, model_def
from spotline.planning.memory_model import ADAM_BYTES, MASTER_BYTES, precision
from spotline.planning.partition import stage_bounds
from spotline.units import human_bytes

KEEPER_THREADS = 4
"""Calls a state keeper answers at once: copies arriving, questions, restores' reads."""
READ_PIECE = 4 * 1024**2
"""The most a restoring rank reads from a keeper in one call: a keeper's reads on their
way out (copied out, then in Ray's object store) are at most KEEPER_THREADS of these."""


@dataclass(frozen=True)
class PeerLevel:
    steps: int
    """Steps each rank's copy is kept for: 2 (the newest complete and the one arriving),
    1, or 0 (no peer snapshots)."""
    buddy: bool
    """Also on another node, so that a lost node's copies live on."""

    def copy(self, own: int, buddy: int) -> int:
        """Bytes of one step's copies a keeper holds at this level: its own ranks'
        (`own` bytes) and, with buddies, the ranks' of the node before it (`buddy`)."""
        return (own + (buddy if self.buddy else 0)) if self.steps else 0

    def held(self, own: int, buddy: int) -> int:
        """Bytes in the keeper's own memory at this level: `steps` copies and its
        working heap (what its process reserves from Ray)."""
        if not self.steps:
            return 0
        return self.steps * self.copy(own, buddy) + constants.SPOTLINE_KEEPER_HEAP_BYTES

    def need(self, own: int, buddy: int) -> int:
        """Bytes the node holds for its keeper at this level: `steps` copies, the copy
        arriving once more in Ray's object store until the keeper has it, and the
        keeper's working heap."""
        if not self.steps:
            return 0
        return self.held(own, buddy) + self.copy(own, buddy)

    def restore(self, source: int, own: int, buddy: int) -> int:
        """The most a keeper holds around a restore: the step restored from (`source`
        bytes, pinned), with the reads on their way out; then, keeping two steps, the
        new group's (`own`, `buddy`) first copy arriving while the source stands in for
        its settled step. With one step the source goes as that copy arrives."""
        if not self.steps:
            return 0
        reading = source + 2 * min(source, KEEPER_THREADS * READ_PIECE)
        window = source + 2 * self.copy(own, buddy) if self.steps >= 2 else 0
        return max(reading, window) + constants.SPOTLINE_KEEPER_HEAP_BYTES

    def describe(self) -> str:
        if not self.steps:
            return "no peer snapshots"
        kept = "two kept steps" if self.steps == 2 else "one kept step"
        return f"{kept}, " + ("on own and buddy nodes" if self.buddy else "on own node only")


LEVELS = (PeerLevel(2, True), PeerLevel(1, True), PeerLevel(1, False), PeerLevel(0, False))
"""The degrade order, fullest first."""


def fit_level(own: int, buddy: int, budget: int | None) -> PeerLevel:
    """The fullest level whose keeper bytes fit `budget` (None: unknown, the fullest)."""
    if budget is None:
        return LEVELS[0]
    return next(lv for lv in LEVELS if lv.need(own, buddy) <= budget)


PLAN_MARGIN = 0.01
"""What the plan adds to each predicted copy: the files a rank writes differ from the
prediction by a little either way (its meta file, headers), and a budget the plan says
fits must hold the copies as measured."""
RNG_META_BYTES = 34_000
"""A rank's meta file holds its RNG states (Python, NumPy, torch) as JSON: about this."""
ENTRY_BYTES = 500
"""One saved tensor fragment's index entry (meta file) and safetensors header entry."""


def rank_copy_bytes(spec: JobSpec, replicas: int, bounds: list[int] | None = None) -> list[int]:
    """Bytes of each rank's peer copy (by rank: stage * replicas + replica), which are
    its checkpoint files: its share of its stage's fp32 master and Adam moments, plus
    the 16-bit weights on replica 0, plus its meta file (RNG states, index entries)."""
    model = model_def(spec)
    bounds = bounds or stage_bounds(model, spec.parallel.pipeline_stages)
    sizes = layer_tensor_sizes(model)
    zero = spec.parallel.zero_stage
    lp = 2 if precision(spec) == "bf16" and zero < 3 else 0
    kinds = 1 + ADAM_BYTES // 4  # the fp32 master and the two moments
    out = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        tensors = [n for layer in sizes[lo:hi] for n in layer]
        params = sum(tensors)
        opt = (MASTER_BYTES + ADAM_BYTES) * params
        for replica in range(replicas):
            # ZeRO >= 1 splits it over the replicas (a rank's slice of the stage's flat
            # buffer touches about its share of the tensors, plus one at each end); under
            # ZeRO-0 replica 0 writes it whole and the others hold copies.
            if zero >= 1:
                mine, pieces = math.ceil(opt / replicas), math.ceil(len(tensors) / replicas) + 1
            else:
                mine, pieces = (opt, len(tensors)) if replica == 0 else (0, 0)
            entries = kinds * pieces + (len(tensors) if lp and replica == 0 else 0)
            weights = lp * params if replica == 0 else 0
            out.append(mine + weights + RNG_META_BYTES + ENTRY_BYTES * entries)
    return out


def node_ranks(stages: int, replicas: int, ranks_per_node: int) -> list[list[int]]:
    """The ranks each node holds when a replica's stages are packed together (one
    placement group per replica) and nodes fill up in replica order."""
    order = [s * replicas + r for r in range(replicas) for s in range(stages)]
    return [order[i : i + ranks_per_node] for i in range(0, len(order), ranks_per_node)]


def _busiest(per_rank: list[int], stages: int, replicas: int, per_node: int) -> tuple[int, int]:
    """(own, buddy) bytes of one copy on the busiest node's keeper at `replicas`."""
    nodes = node_ranks(stages, replicas, max(1, per_node))
    sums = [sum(per_rank[r] for r in ranks) for ranks in nodes]
    if len(sums) == 1:
        return sums[0], 0
    # Node i keeps its own ranks' copies and those of node i-1 (the ring).
    return max(((sums[i], sums[i - 1]) for i in range(len(sums))), key=sum)


@dataclass(frozen=True)
class NodePeerMemory:
    """The busiest node's keeper over the shapes the job runs at: every replica count in
    its elastic range (a node's share of the state grows as the ring gets shorter), with
    the restores between them."""

    own: int
    """Bytes of one copy of its own ranks' state, at the planned replicas."""
    buddy: int
    """Bytes of one copy of its buddy ranks' state (0 on a one-node group)."""
    budget: int | None
    node_ram: int | None
    level: PeerLevel
    shapes: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Replica count -> (own, buddy) of the busiest node, for every count the job may
    run at (predicted, with PLAN_MARGIN)."""

    def _worst(self, level: PeerLevel) -> tuple[int, int, int]:
        """(steady, restore, replicas where steady peaks) at `level`."""
        shapes = self.shapes or {0: (self.own, self.buddy)}
        at = max(shapes, key=lambda r: level.need(*shapes[r]))
        restore = max(
            level.restore(level.copy(*shapes[a]), *shapes[b]) for a in shapes for b in shapes
        )
        return level.need(*shapes[at]), restore, at

    @property
    def need(self) -> int:
        """The most the node holds at the level it gets, a restore's peak included."""
        return max(self._worst(self.level)[:2])

    @property
    def full(self) -> int:
        """What keeping two steps with buddies needs at most."""
        return max(self._worst(LEVELS[0])[:2])

    @property
    def restore_peak(self) -> int:
        """The most the node holds around a restore at the level it gets."""
        return self._worst(self.level)[1]

    def render(self) -> str:
        ram = f" of {human_bytes(self.node_ram)} RAM" if self.node_ram else ""
        budget = (
            f"budget {human_bytes(self.budget)}{ram} (recovery.peer_memory)"
            if self.budget is not None
            else "budget unknown (give recovery.peer_memory as a size, or resources.node_memory_gb)"
        )
        steady, restore, at = self._worst(LEVELS[0])
        own, buddy = (self.shapes or {at: (self.own, self.buddy)})[at]
        head = (
            f"{human_bytes(max(steady, restore))} per node at most: "
            f"{human_bytes(steady)} training at {at} replica(s) (2 steps x "
            f"{human_bytes(own)} own + {human_bytes(buddy)} buddy, and a copy arriving "
            f"through Ray's object store), {human_bytes(restore)} around a restore (the step "
            f"restored from, its reads, the new group's first copy); {budget}"
        )
        if self.level == LEVELS[0]:
            return f"{head}: fits"
        return (
            f"{head}: does NOT fit; degrades to {self.level.describe()} ({human_bytes(self.need)})"
        )


def node_peer_memory(
    spec: JobSpec,
    replicas: int,
    ranks_per_node: int,
    node_ram: int | None,
    bounds: list[int] | None = None,
) -> NodePeerMemory:
    """The busiest node's keeper at every replica count the job runs at (it starts at
    `replicas`, shrinks as nodes go, grows as they come), `ranks_per_node` ranks on a
    node; the level is the fullest that fits every shape and every restore between
    them."""
    stages = spec.parallel.pipeline_stages

    def predicted(r: int) -> list[int]:  # a prediction: rounded up, never under the copy
        return [math.ceil(b * (1 + PLAN_MARGIN)) for b in rank_copy_bytes(spec, r, bounds)]

    shapes = {
        r: _busiest(predicted(r), stages, r, ranks_per_node)
        for r in sorted(set(spec.replica_counts()) | {replicas}, reverse=True)
    }
    own, buddy = shapes[replicas]
    budget = spec.recovery.peer_budget_bytes(node_ram)
    level = LEVELS[-1]
    for lv in LEVELS:
        probe = NodePeerMemory(own, buddy, budget, node_ram, lv, shapes)
        if budget is None or probe.need <= budget:
            level = lv
            break
    return NodePeerMemory(own, buddy, budget, node_ram, level, shapes)
