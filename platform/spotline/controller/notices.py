"""Just-in-time checkpoints before a preemption: when to save, and the notices' record.

`JitPolicy` decides at which step the save of a notice is taken, and whether a late
step must move up because steps slowed down; `predicted_save_s` is the save time
those decisions weigh. `JitBook` holds the notices the next commit answers (they
outlive a failed group: the next group's checkpoint answers them) and writes their
outcome. Policies and the book do no I/O and hold no Ray handles.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from spotline.planning.checkpoint_time import jit_fit_problem
from spotline.planning.checkpoint_time import predicted_save_s as planned_save_s


class JitPolicy:
    """At which step to take the just-in-time checkpoint of a preemption notice.

    Moving at once (save after the next step, then restart on what is left) forfeits
    the doomed node's capacity for the rest of the notice; staying trains at the full
    size until the latest step whose save still ends before the deadline with a margin.
    With W = deadline - now - margin, step time t, predicted save time S (host copy +
    upload + commit), and rates r now and r' on what is left (r' = r x D'/D unless
    measured):

        stay:  k = floor((W - S) / t) more steps, then save
        move:  1 step, then the smaller group trains for about W - t
        stay   iff  k > 1 + r' x (W - t)

    Both then restart once; counted at the moment the stayer's new group starts, the
    mover has trained r' x (W - t) steps more at the smaller size. A long notice (AWS:
    120 s) with a fast save usually stays; a short one (GCP, Azure: 30 s) moves.
    """

    def __init__(self, margin_s: float):
        self.margin_s = margin_s

    def decide(
        self,
        *,
        step: int,
        seconds_left: float,
        step_s: float,
        save_s: float,
        replicas: int,
        replicas_after: int,
        rate_after: float | None = None,
    ) -> int:
        """The step to save at: step + 1 (move at once) or a later one (stay)."""
        w = seconds_left - self.margin_s
        if step_s <= 0 or w <= save_s + step_s:
            return step + 1
        k = int((w - save_s) // step_s)
        r_after = rate_after if rate_after is not None else (replicas_after / replicas) / step_s
        if k > 1 + r_after * (w - step_s):
            return step + k
        return step + 1

    def recheck(
        self, *, step: int, planned: int, step_s: float | None, save_s: float, seconds_left: float
    ) -> MoveUp | None:
        """A late step was picked from the step time measured then. Should steps slow
        down (a busy node, a slow link), reaching it and saving could miss the deadline:
        then the save moves up to the next step."""
        if step_s is None or planned <= step + 1:
            return None
        window = seconds_left - self.margin_s
        need = (planned - step) * step_s + save_s
        if need <= window:
            return None
        return MoveUp(step + 1, need_s=need, window_s=window)


@dataclass(frozen=True)
class MoveUp:
    """Save at `step` instead: the planned one needs `need_s` of the `window_s` left."""

    step: int
    need_s: float
    window_s: float


def predicted_save_s(blocked_s: list[float], upload_s: list[float], poll_s: float) -> float | None:
    """Host copy + serialization + upload + commit of one checkpoint, from what this job
    measured; None before its first measured upload."""
    if not upload_s:
        return None
    return max(blocked_s[-1] if blocked_s else 0.0, 0.0) + upload_s[-1] + 2 * poll_s


class JitBook:
    """The notices a just-in-time checkpoint answers, the steps it saves at (from
    `JitPolicy`), and the check that one can meet the shortest notice.

    `pace`: the job's measured pace (`pace.Pace`); `fig`: telemetry's figures (the
    saves' blocked and upload times); `event(text, level, track)`; `clock`: the
    controller's (`clock.Clock`: a notice's deadline is wall time).
    """

    def __init__(self, spec, policy: JitPolicy, pace, fig, event, poll_s: float, clock):
        self.spec = spec
        self.policy = policy
        self.pace = pace
        self.fig = fig
        self._event = event
        self.poll_s = poll_s
        self.clock = clock
        self.pending: list[dict[str, Any]] = []  # notices the next leave answers
        self.notices: list[dict[str, Any]] = []
        """Every notice once its outcome is known (status and the result show them)."""
        self._fit_checked = False  # the check from the first measured save is done

    def triage(self, notices, step: int, live: set[str] | None, drain) -> list[dict[str, Any]]:
        """New notices: each is logged and its node drained (`drain(node, deadline,
        reason)`); those for the live group's nodes (`live`: None without a group) are
        returned for a just-in-time checkpoint, the others get their outcome now."""
        jit: list[dict[str, Any]] = []
        for n in notices:
            node = n.get("node_id")
            left = n["deadline"] - self.clock.wall()
            where = f"node {node[:12]}" if node else "an unnamed node"
            self._event(
                f"preemption notice ({n['source']}: {n['reason']}) for {where}, "
                f"{left:.0f}s before its deadline",
                logging.WARNING,
                track="preemption",
            )
            if node is not None:
                drain(node, n["deadline"], f"{n['source']}: {n['reason']}")
            n["step"] = step
            if live is not None and (node is None or node in live):
                jit.append(n)
            else:
                n["outcome"] = (
                    "no ranks of this job on that node; it is drained"
                    if live is not None
                    else "no group running; the node is drained, the next group avoids it"
                )
                self.notices.append(n)
        return jit

    def plan(self, notices, step: int, replicas: int, replicas_after: int) -> tuple[int, float]:
        """The step to save at for `notices` (at once, or as late as the deadline allows
        when staying on the doomed capacity gains steps), and their deadline."""
        deadline = min(n["deadline"] for n in notices)
        save_s = self.save_s(replicas)
        at = self.policy.decide(
            step=step,
            seconds_left=deadline - self.clock.wall(),
            step_s=self.pace.wall_step_s() or 0.0,
            save_s=save_s,
            replicas=replicas,
            replicas_after=replicas_after,
            rate_after=self.pace.sps.get(replicas_after),
        )
        plan = "at once" if at == step + 1 else f"after {at - step} more step(s)"
        self._event(
            f"just-in-time checkpoint {plan} (step {at}; predicted save {save_s:.1f}s, "
            f"{deadline - self.clock.wall():.0f}s to the deadline)"
        )
        return at, deadline

    def recheck(self, planned: int, step: int, deadline: float, replicas: int) -> int | None:
        """The step a late save moves up to when steps slowed down, or None."""
        step_s = self.pace.wall_step_s()
        if step_s is None or planned <= step + 1:
            return None
        move = self.policy.recheck(
            step=step,
            planned=planned,
            step_s=step_s,
            save_s=self.save_s(replicas),
            seconds_left=deadline - self.clock.wall(),
        )
        if move is None:
            return None
        self._event(
            f"steps slowed to {step_s * 1e3:.0f} ms: saving step {planned} would need "
            f"{move.need_s:.0f}s of the {move.window_s:.0f}s left before the notice's deadline "
            f"(less the margin); the just-in-time checkpoint moves up to step {move.step}",
            logging.WARNING,
        )
        return move.step

    def save_s(self, replicas: int | None) -> float:
        """The save time to plan with: the measured one, or before the first commit the
        state size at an assumed rate."""
        measured = predicted_save_s(self.fig.blocked_s, self.fig.upload_s, self.poll_s)
        if measured is not None:
            return measured
        return planned_save_s(self.spec, replicas or self.spec.replica_counts()[0])

    def check_fit(self, replicas: int | None = None) -> None:
        """Say so when a just-in-time checkpoint cannot meet the shortest notice: at the
        start from the state size (`replicas` None), and once more from the first
        measured save (of the live group, at `replicas`)."""
        if replicas is None:
            problem = jit_fit_problem(self.spec, self.spec.replica_counts()[0])
        else:
            if self._fit_checked:
                return
            self._fit_checked = True
            sps = self.pace.sps.get(replicas)
            problem = jit_fit_problem(
                self.spec, replicas, save_s=self.save_s(replicas), step_s=1.0 / sps if sps else 0.0
            )
        if problem:
            self._event(f"warning: {problem}", logging.WARNING)

    def answer(self, step: int, committed: bool, latest: int | None, now: float) -> None:
        """The pending notices, answered by step `step` (committed or not), into the
        record; `latest`: the latest committed step, `now`: the controller's clock."""
        for n in self.pending:
            n["committed_step"] = step if committed else latest
            n["notice_to_commit_s"] = now - n["received_clock"] if committed else None
            n["committed_at"] = self.clock.wall() if committed else None
            n["before_deadline_s"] = n["deadline"] - self.clock.wall()
            n["outcome"] = "just-in-time checkpoint committed" if committed else "commit failed"
            self.notices.append(n)
        if self.pending and committed:
            first = self.pending[0]
            took = now - first["received_clock"]
            budget = self.spec.preemption.jit_checkpoint_budget_s
            self._event(
                f"just-in-time checkpoint step {step} committed {took:.1f}s after the notice, "
                f"{first['deadline'] - self.clock.wall():.0f}s before the deadline"
                + (
                    f"; that is over preemption.jit_checkpoint_budget_s ({budget:.0f}s)"
                    if took > budget
                    else ""
                ),
                logging.WARNING if took > budget else logging.INFO,
            )
        self.pending = []
