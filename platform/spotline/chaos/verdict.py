"""What a rehearsal found: exact resume, lost work per event, notice and recovery times,
goodput, what the job's own settings cost, and the verdict with each reason.

Pure functions of what the runs recorded (their results, the events as applied, the
samples of their progress): no Ray, no cluster. `spotline.testing`'s assertions use the
same checks (`first_difference`, `lost_commits`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

# Losses compare equal within this relative tolerance: a group at another replica count
# sums its gradients in another order, which moves the last bits.
DEFAULT_TOLERANCE = 1e-4
DRIFT_WINDOW_STEPS = 50
"""Steps a job that trained at another replica count than the uninterrupted run is
compared with that run, from the first such step. Summed in another order, the losses
differ in their last bits at first and further with every step (seen: beyond 1e-4
relative after 300 steps at 1 replica against 2); past the window each resumed group's
first steps are compared with those an earlier group trained, instead."""
RESUME_STEPS = 5
"""A resumed group's first steps that no earlier group trained, past the window: compared
with the uninterrupted run, allowing DRIFT_ALLOWANCE times the largest difference of the
RESUME_STEPS steps before the resume (the drift it resumed into)."""
DRIFT_ALLOWANCE = 10.0
ENDS = {"notice": "preemption notice", "loss": "node lost", "gone": "node lost"}


@dataclass
class Applied:
    """One trace event as it landed on the cluster, and the job at that moment."""

    at: float
    """Seconds from the job's first step."""
    t: float
    """Wall clock."""
    kind: str
    node: int
    node_id: str
    deadline_s: float | None = None
    step: int = 0
    committed: int | None = None
    """The newest committed step then."""
    attempt: int | None = None
    """Index of the group running then (None: none was)."""
    hit: bool = False
    """The job had ranks on that node."""
    replicas: int = 0


@dataclass
class EventReport:
    """One event's cost: what the rehearsal reports and --json writes per event."""

    at: float
    kind: str
    node: int
    node_id: str
    hit: bool
    step: int
    deadline_s: float | None = None
    committed_step: int | None = None
    notice_to_commit_s: float | None = None
    before_deadline_s: float | None = None
    outcome: str | None = None
    steps_lost: int = 0
    restored_from: int | None = None
    restored_via: str | None = None
    training_again_s: float | None = None
    used_after_s: float | None = None
    """Joins: seconds until the job had ranks on the new node (None: it did not)."""

    def line(self) -> str:
        head = f"{self.at:6.1f}s  {self.kind:<6} node {self.node}"
        if self.kind == "join":
            used = (
                f"used by the job after {self.used_after_s:.1f}s"
                if self.used_after_s is not None
                else "not used by the job"
            )
            return f"{head}: {used}"
        if not self.hit:
            return f"{head}: no rank of the job there"
        parts = []
        if self.kind == "notice":
            if self.notice_to_commit_s is not None:
                parts.append(
                    f"committed step {self.committed_step} {self.notice_to_commit_s:.1f}s after "
                    f"the notice, {self.before_deadline_s:.1f}s before its {self.deadline_s:g}s "
                    "deadline"
                )
            else:
                parts.append(self.outcome or "the job did not answer it")
        parts.append(f"{self.steps_lost} step(s) lost")
        if self.restored_from is not None:
            parts.append(f"resumed from step {self.restored_from} ({self.restored_via})")
        if self.training_again_s is not None:
            parts.append(f"training again after {self.training_again_s:.1f}s")
        return f"{head}: " + "; ".join(parts)


# --- exact resume -------------------------------------------------------------------------


@dataclass
class Difference:
    compared: int
    identical: int
    """Steps bit for bit equal."""
    first: int | None
    max_rel: float
    got: float | None = None
    want: float | None = None
    against: str = "the uninterrupted run"
    """Whose loss `want` is: the uninterrupted run's, or an earlier group's."""
    drift_from: int | None = None
    """The first step the job trained at another replica count than the uninterrupted run
    (None: it never did, and every step was compared with that run)."""
    replayed: int = 0
    """Steps compared with the loss an earlier group trained for the same step."""
    bounded: int = 0
    """Resumed groups' first steps compared with the uninterrupted run within the drift
    they resumed into (see RESUME_STEPS)."""
    unchecked: list[int] = field(default_factory=list)
    """Steps resumed from whose group's first steps nothing could be compared with."""


def first_difference(
    losses: dict[int, float],
    reference: dict[int, float],
    upto: int | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    attempts: list[dict[str, Any]] | None = None,
    ref_attempts: list[dict[str, Any]] | None = None,
    window: int = DRIFT_WINDOW_STEPS,
) -> Difference:
    """The first step (up to `upto`) whose loss differs by more than `tolerance`
    (relative) from the reference's, over the steps both have.

    Given the groups (`attempts`, `ref_attempts`: each with its `replicas` and its
    `losses`, [step, loss] pairs), a job that trained at another replica count than the
    reference is compared with it for `window` steps from the first such step only (see
    DRIFT_WINDOW_STEPS); after that, each group that resumed is compared over its first
    `window` steps with the losses an earlier group trained for the same steps, from the
    same committed state, or, where none did, over its first RESUME_STEPS steps with the
    reference, within the drift it resumed into."""
    drift = _drift_from(attempts or [], ref_attempts or [])
    horizon = None if drift is None else drift + window - 1
    last = horizon if upto is None else upto if horizon is None else min(upto, horizon)
    d = _compare(losses, reference, last, tolerance)
    d.drift_from = drift
    if drift is None or d.first is not None:
        return d
    assert horizon is not None
    earlier: dict[int, float] = {}  # the losses of the groups before, the latest per step
    for i, a in enumerate(attempts or []):
        mine = {int(s): v for s, v in a.get("losses") or []}
        start = a.get("restored_from") or 0
        if i and mine:
            r = _resume_check(
                mine, start, earlier, losses, reference, horizon, upto, tolerance, window
            )
            if r is None:
                d.unchecked.append(start)
            else:
                d.compared, d.identical = d.compared + r.compared, d.identical + r.identical
                d.max_rel = max(d.max_rel, r.max_rel)
                d.replayed += r.replayed
                d.bounded += r.bounded
                if r.first is not None:
                    d.first, d.got, d.want, d.against = r.first, r.got, r.want, r.against
                    return d
        earlier.update(mine)
    return d


def _resume_check(
    mine: dict[int, float],
    start: int,
    earlier: dict[int, float],
    losses: dict[int, float],
    reference: dict[int, float],
    horizon: int,
    upto: int | None,
    tolerance: float,
    window: int,
) -> Difference | None:
    """A group resumed from `start`, past the drift window: its first `window` steps
    against the same steps of the groups before it, or, where they trained none, its
    first RESUME_STEPS steps against the reference within the drift before the resume
    (None: nothing to compare them with)."""
    steps = {
        s: v for s, v in mine.items() if start < s <= start + window and (upto is None or s <= upto)
    }
    theirs = {s: earlier[s] for s in steps if s > horizon and s in earlier}
    if theirs or any(s <= horizon for s in steps):
        r = _compare(steps, theirs, None, tolerance)
        r.replayed = r.compared
        r.against = (
            f"the group before it (the group resumed from step {start} trained it "
            "again from the same committed step)"
        )
        return r
    before = {s: v for s, v in losses.items() if start - RESUME_STEPS < s <= start}
    drift_before = _compare(before, reference, None, math.inf)
    if not drift_before.compared:
        return None
    allowed = max(tolerance, DRIFT_ALLOWANCE * drift_before.max_rel)
    first = {s: v for s, v in steps.items() if s <= start + RESUME_STEPS}
    r = _compare(first, reference, None, allowed)
    r.bounded = r.compared
    return r


def _compare(
    losses: dict[int, float], reference: dict[int, float], upto: int | None, tolerance: float
) -> Difference:
    steps = sorted(s for s in losses if s in reference and (upto is None or s <= upto))
    first, got, want, worst, same = None, None, None, 0.0, 0
    for s in steps:
        a, b = float(losses[s]), float(reference[s])
        same += a == b
        rel = abs(a - b) / max(abs(b), 1e-12) if not (math.isnan(a) or math.isnan(b)) else math.inf
        worst = max(worst, rel)
        if first is None and rel > tolerance:
            first, got, want = s, a, b
    return Difference(len(steps), same, first, worst, got, want)


def _drift_from(attempts: list[dict[str, Any]], ref_attempts: list[dict[str, Any]]) -> int | None:
    """The first step both runs trained, the job's at another replica count than the
    reference's (each step counted for the group that trained it last)."""
    mine, theirs = _replicas_by_step(attempts), _replicas_by_step(ref_attempts)
    return next((s for s in sorted(mine) if s in theirs and mine[s] != theirs[s]), None)


def _replicas_by_step(attempts: list[dict[str, Any]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for a in attempts:
        out.update({int(s): a.get("replicas") for s, _ in a.get("losses") or []})
    return out


def lost_commits(attempts: list[dict[str, Any]], events: list[Applied]) -> list[str]:
    """Each time a restore went behind a step committed before the event that ended its
    group: one line each (none: no committed step was lost)."""
    out = []
    for e in events:
        if e.attempt is None or e.committed is None or e.attempt + 1 >= len(attempts):
            continue
        nxt = attempts[e.attempt + 1]
        restored = nxt.get("restored_from") or 0
        if restored < e.committed:
            out.append(
                f"after the {e.kind} at {e.at:.1f}s the job resumed from step {restored}, "
                f"behind step {e.committed}, committed before it"
            )
    return out


# --- per event ------------------------------------------------------------------------------


def event_reports(
    applied: list[Applied],
    attempts: list[dict[str, Any]],
    notices: list[dict[str, Any]],
    recoveries: list[dict[str, Any]],
    samples: list[dict[str, Any]],
) -> list[EventReport]:
    """What each event cost the job (see `EventReport`)."""
    out = []
    answered = list(notices)
    for e in applied:
        r = EventReport(e.at, e.kind, e.node, e.node_id, e.hit, e.step, e.deadline_s)
        if e.kind == "join":
            r.hit = True
            r.used_after_s = _used_after(e, samples)
            out.append(r)
            continue
        if e.kind == "notice":
            n = next((x for x in answered if x.get("node_id") == e.node_id), None)
            if n is not None:
                answered.remove(n)
                r.outcome = n.get("outcome")
                r.committed_step = n.get("committed_step")
                r.notice_to_commit_s = n.get("notice_to_commit_s")
                r.before_deadline_s = n.get("before_deadline_s")
                r.hit = r.hit or r.notice_to_commit_s is not None
            elif e.hit:
                r.outcome = "not seen by the job (no notice source)"
        i = e.attempt
        if e.hit and i is not None and i + 1 < len(attempts):
            ended = attempts[i].get("ended_by")
            if ended in (ENDS[e.kind], "failure") or (e.kind != "notice" and ended):
                trained = [s for s, _ in attempts[i].get("losses") or []]
                nxt = attempts[i + 1]
                r.restored_from = nxt.get("restored_from") or 0
                r.restored_via = nxt.get("restored_via") or "a fresh start"
                r.steps_lost = max(0, (max(trained) if trained else 0) - r.restored_from)
                later = [x["resumed_at"] - e.t for x in recoveries if x["resumed_at"] >= e.t]
                r.training_again_s = min(later) if later else None
        out.append(r)
    return out


def _used_after(e: Applied, samples: list[dict[str, Any]]) -> float | None:
    for s in samples:
        if s["t"] >= e.t and e.node_id in s.get("nodes", ()):
            return s["t"] - e.t
    return None


# --- the job's own settings --------------------------------------------------------------------


def settings_costs(
    spec: Any,
    reports: list[EventReport],
    steps_per_s: float | None,
    peer: dict[str, Any] | None,
    waited_s: float,
) -> list[str]:
    """What the job's own settings cost under this trace, one line each, with the
    setting that would cost less."""
    lines = []
    interval = spec.checkpoint.interval_steps
    rate = f" (about {interval / steps_per_s:.0f}s of training here)" if steps_per_s else ""
    losses = [r for r in reports if r.kind in ("loss", "gone") and r.hit]
    lost = [r.steps_lost for r in losses]
    k = (peer or {}).get("every_steps") or spec.recovery.fixed_interval()
    if not spec.recovery.peer_snapshots:
        line = (
            f"checkpoint.interval_steps {interval} loses up to {interval} steps on a loss "
            f"without notice{rate}"
        )
        if lost:
            line += f"; here {sum(lost)} step(s) were lost to {len(lost)} loss(es)"
        line += (
            "; recovery.peer_snapshots: true would lose at most k steps (a peer copy every "
            f"k steps, k chosen to cost at most recovery.peer_cost_budget, "
            f"{spec.recovery.peer_cost_budget:.0%} of training)"
        )
        spacing = _steps_between_losses(losses, steps_per_s)
        if spacing and interval > spacing / 10:
            line += (
                f", or commit more often: checkpoint.interval_steps {max(1, int(spacing / 10))} "
                f"loses at most a tenth of the ~{spacing:.0f} steps between losses here"
            )
        lines.append(line)
    else:
        at_most = f"at most {k}" if k else "at most k (measured as it runs)"
        line = (
            f"recovery.peer_snapshots: a loss without notice loses {at_most} steps, or up to "
            f"checkpoint.interval_steps ({interval}) when a node and its buddy go together"
        )
        if lost:
            line += f"; here {sum(lost)} step(s) were lost to {len(lost)} loss(es)"
        lines.append(line)
    notices = [r for r in reports if r.kind == "notice"]
    if notices and not spec.preemption.sources:
        cost = sum(r.steps_lost for r in reports if r.kind == "gone" and r.hit)
        lines.append(
            f"preemption.sources is empty: the job saw none of the {len(notices)} notice(s), "
            f"so each cost what a loss without notice costs ({cost} step(s) here); add your "
            "cloud's source ({kind: aws}, gcp, azure) or ray-drain where the autoscaler or "
            "KubeRay drains nodes"
        )
    answered = [r for r in notices if r.notice_to_commit_s is not None and r.deadline_s]
    if answered:
        worst = max(answered, key=lambda r: r.notice_to_commit_s / r.deadline_s)
        share = worst.notice_to_commit_s / worst.deadline_s
        lines.append(
            f"just-in-time checkpoints took up to {worst.notice_to_commit_s:.1f}s of a "
            f"{worst.deadline_s:g}s notice ({share:.0%})"
            + (
                "; little margin: a larger state or slower storage would miss it (see "
                "`spotline plan`)"
                if share > 0.5
                else ""
            )
        )
    e = spec.elastic
    if waited_s > 1 and e.min_replicas == e.max_replicas:
        lines.append(
            f"elastic.min_replicas {e.min_replicas} = max_replicas: the job stopped training "
            f"for {waited_s:.0f}s waiting for capacity after notices and losses; "
            "elastic.min_replicas: 1 would go on with the replicas left"
        )
    elif waited_s > 1:
        lines.append(
            f"elastic.min_replicas {e.min_replicas}: the job waited {waited_s:.0f}s below it "
            "for capacity"
        )
    return lines


def _steps_between_losses(losses: list[EventReport], steps_per_s: float | None) -> float | None:
    if not losses or not steps_per_s:
        return None
    times = sorted(r.at for r in losses)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    return min(gaps) * steps_per_s if gaps else None


# --- the verdict ------------------------------------------------------------------------------


@dataclass
class Verdict:
    verdict: str
    reasons: list[str] = field(default_factory=list)
    """Why it failed (each a line), or what passed."""
    exact_resume: bool | None = None
    not_exactly_resumable: bool = False
    """The job's own data or code is not deterministic: its fault, not Spotline's."""
    first_differing_step: int | None = None
    why_different: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def judge(
    *,
    state: str,
    error: str | None,
    diff: Difference,
    first_restart_step: int | None,
    data_pure: tuple[bool, str] | None,
    lost: list[str],
    reports: list[EventReport],
    unreplayed: int,
    goodput: float | None,
    min_goodput: float | None,
    tolerance: float,
) -> Verdict:
    """PASS when the job ran on through every event, resumed exactly, lost no committed
    step, committed each notice it saw before the deadline (and kept --min-goodput)."""
    fails: list[str] = []
    passes: list[str] = []
    if state == "failed":
        fails.append(f"the job failed: {error}")
    v = Verdict("FAIL")
    if diff.compared == 0:
        trained = max((r.step for r in reports), default=0)
        fails.append(
            "the job committed no step under the trace, so nothing was kept"
            + (f" (it trained to step {trained} at most)" if trained else "")
            + ": see what its settings cost below, and the timeline"
        )
    elif diff.first is None:
        v.exact_resume = True
        rest = diff.compared - diff.identical
        equal = (
            "bit for bit"
            if not rest
            else f"{diff.identical} bit for bit, {rest} within {tolerance:g} relative"
        )
        if diff.drift_from is None:
            passes.append(
                f"exact resume: all {diff.compared} committed steps have the uninterrupted "
                f"run's loss, {equal}"
            )
        else:
            passes.append(
                f"exact resume: {diff.compared} steps compared, {equal}: "
                f"{diff.compared - diff.replayed - diff.bounded} with the uninterrupted run up to "
                f"{DRIFT_WINDOW_STEPS} steps after step {diff.drift_from}, where the job "
                "first trained at another replica count than that run (summed in another "
                "order, losses drift apart step by step), and "
                f"{diff.replayed} of later resumed groups' first steps with an earlier "
                "group's loss for the same step"
                + (
                    f", {diff.bounded} with the uninterrupted run within "
                    f"{DRIFT_ALLOWANCE:g} times the drift before their resume"
                    if diff.bounded
                    else ""
                )
                + (
                    "; not checked: the groups resumed from step(s) "
                    + ", ".join(str(u) for u in diff.unchecked)
                    + ", whose first steps no earlier group trained"
                    if diff.unchecked
                    else ""
                )
            )
    else:
        v.exact_resume = False
        v.first_differing_step = diff.first
        v.why_different, v.not_exactly_resumable = _why(diff, first_restart_step, data_pure)
        fails.append(
            f"not exactly resumable: step {diff.first} has loss {diff.got:.6g}, "
            f"{diff.against} {diff.want:.6g}; {v.why_different}"
            if v.not_exactly_resumable
            else f"resume differs from {diff.against} at step {diff.first} "
            f"({diff.got:.6g} vs {diff.want:.6g}); {v.why_different}"
        )
    faults = [r for r in reports if r.kind != "join"]
    if faults and not any(r.hit for r in faults):
        where = ", ".join(f"the {r.kind} at {r.at:.1f}s (node {r.node})" for r in faults)
        fails.append(
            f"no fault of the trace reached the job: {where} found none of its ranks, so "
            "nothing was rehearsed; see the timeline for where its ranks ran, and rerun"
        )
    if lost:
        fails += [f"a committed step was lost: {x}" for x in lost]
    elif any(r.hit for r in faults):
        passes.append("no committed step was lost")
    for r in reports:
        late = r.before_deadline_s is not None and r.before_deadline_s < 0
        if r.kind == "notice" and r.hit and (late or r.outcome == "commit failed"):
            fails.append(
                f"the notice at {r.at:.1f}s for node {r.node} was not answered in time: "
                f"{r.outcome}"
                + (f", {-r.before_deadline_s:.1f}s after its deadline" if late else "")
                + "; see the settings below"
            )
    if unreplayed:
        fails.append(
            f"{unreplayed} of the trace's events came after the job had finished: raise "
            "train.steps (--set train.steps=N) or shorten --duration, so the trace is replayed whole"
        )
    if min_goodput is not None and goodput is not None and goodput < min_goodput:
        fails.append(f"goodput {goodput:.1%} is below --min-goodput {min_goodput:.0%}")
    v.verdict = "FAIL" if fails else "PASS"
    v.reasons = fails or passes
    return v


def _why(
    diff: Difference, first_restart_step: int | None, data_pure: tuple[bool, str] | None
) -> tuple[str, bool]:
    """Why step `diff.first` differs, and whether that is the job's own doing."""
    if data_pure is not None and not data_pure[0]:
        return (
            f"the job's data is not a pure function of the step ({data_pure[1]}): a resumed "
            "group draws other batches than the uninterrupted run did. Make batch k depend "
            "only on (data.seed, k)",
            True,
        )
    if first_restart_step is None or diff.first <= first_restart_step:
        return (
            "it differs before any interruption, so the job itself is not deterministic "
            "from its seed (its model, data or kernels draw randomness of their own)",
            True,
        )
    return (
        f"the first restart resumed from step {first_restart_step} and the data is a pure "
        "function of the step, so the restored state was not exact: this is Spotline's "
        "failure, please report it with this report directory",
        False,
    )
