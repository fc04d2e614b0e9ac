"""`spotline chaos`: the user's job against a spot trace on a local cluster, then the same
job uninterrupted, compared; the verdict and a report directory.

One cluster serves both runs: the rehearsal first (the trace replayed from its first
step at full size, stopped with a commit when the trace ends), then the cluster is
reset to its fresh nodes and the same job runs uninterrupted from the same seed to the
same step.
Both runs' times count from their first step (start-up is the same for both).
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from spotline import constants
from spotline.chaos.adapt import Adapted, adapt, check_fits, machine_memory, set_flags, worker_cpus
from spotline.chaos.cluster import LocalSpotCluster, SpotNodeShape
from spotline.chaos.traces import Trace, load_trace
from spotline.chaos.verdict import (
    DEFAULT_TOLERANCE,
    Applied,
    event_reports,
    first_difference,
    judge,
    lost_commits,
    settings_costs,
)
from spotline.config import JobSpec, SpecError

POLL_S = constants.SPOTLINE_CHAOS_POLL_S
START_TIMEOUT_S = constants.SPOTLINE_CHAOS_START_TIMEOUT_S
FULL_SIZE_WAIT_S = constants.SPOTLINE_CHAOS_FULL_SIZE_WAIT_S


@dataclass
class Arm:
    """One run of the job and what the driver saw of it."""

    name: str
    result: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] | None = None
    samples: list[dict[str, Any]] = field(default_factory=list)
    """Polls of its status: t (wall), step, replicas, committed, state, nodes."""
    log: list[tuple[float, str]] = field(default_factory=list)
    """(wall, line): the job's own events."""
    t0: float | None = None
    """Wall clock of its first trained step."""
    started: float = 0.0
    ended: float = 0.0

    def reached(self, step: int) -> float | None:
        """Seconds from its first step until it first reached `step`."""
        if self.t0 is None or step < 1:
            return None
        for s in self.samples:
            if s["step"] >= step and s["t"] >= self.t0:
                return s["t"] - self.t0
        return None


def _name(base: str, suffix: str) -> str:
    return f"{base[: 63 - len(suffix)]}{suffix}"


class Rehearsal:
    """Everything one `spotline chaos` does; `run()` returns the figures."""

    def __init__(
        self,
        spec: JobSpec,
        trace: str,
        out: Path,
        *,
        duration_s: float | None = None,
        nodes: int | None = None,
        scale_model: bool = False,
        min_goodput: float | None = None,
        tolerance: float = DEFAULT_TOLERANCE,
        say: Callable[[str], None] = print,
    ) -> None:
        from spotline.preflight import resolve_tokenizer

        self.say = say
        self.out = out
        self.min_goodput = min_goodput
        self.tolerance = tolerance
        resolve_tokenizer(spec)  # the vocabulary, for the fit check
        self.user = spec
        self.trace: Trace = load_trace(trace, nodes, duration_s, spec.elastic.max_replicas)
        self.scratch = Path(tempfile.mkdtemp(prefix="spotline-chaos-"))
        self.chaos = self._adapt("-chaos", scale_model)
        self.reference = self._adapt("-reference", scale_model)
        shrunk = None
        if not scale_model and spec.model.kind != "custom":
            shrunk = self._adapt("-chaos", True)
        self.footprint = check_fits(
            self.chaos,
            self.trace.duration_s,
            machine_memory(),
            shrunk,
            set_flags(shrunk.scaled) if shrunk else "--set model.config.FIELD=VALUE",
        )
        stages = spec.parallel.pipeline_stages
        self.shape = SpotNodeShape(slots=stages, cpus=worker_cpus(self.chaos.spec))

    def _adapt(self, suffix: str, scale: bool) -> Adapted:
        run = suffix.strip("-")
        return adapt(
            self.user,
            name=_name(self.user.name, suffix),
            checkpoint_uri=f"file://{self.scratch / run / 'checkpoints'}",
            staging_dir=str(self.scratch / run / "staging"),
            scale_model=scale,
        )

    # --- the two runs ----------------------------------------------------------------------

    def run(self, cluster: LocalSpotCluster | None = None) -> dict[str, Any]:
        """Both runs on `cluster` (None: a new one, ended at the end); the figures."""
        t = self.trace
        self.say(
            f"spotline chaos: {self.user.name} on {t.nodes} simulated spot node(s) of "
            f"{self.shape.slots} spot_gpu each, trace {t.name!r} ({t.about}), "
            f"{t.duration_s:g}s from the first step"
        )
        for line in self.chaos.changes:
            self.say(f"  changed: {line}")
        self.say(f"  on this machine: {self.footprint.describe()}")
        started = time.time()
        own = cluster is None
        try:
            if cluster is None:
                cluster = LocalSpotCluster(t.nodes, self.shape)
            else:
                cluster.reset(t.nodes)
            self.cluster = cluster
            chaos_arm, applied, unreplayed = self._rehearse(cluster)
            committed = max(chaos_arm.result.get("committed_steps") or [0])
            if committed:
                cluster.reset(t.nodes)
                self.say(f"the same job uninterrupted, from the same seed, to step {committed}")
                ref_arm = self._uninterrupted(committed)
            else:  # nothing to compare: the uninterrupted run would tell nothing
                ref_arm = Arm("reference")
        finally:
            if own and cluster is not None:
                cluster.close()
            shutil.rmtree(self.scratch, ignore_errors=True)
        figures = self._figures(chaos_arm, ref_arm, applied, unreplayed, committed)
        figures["wall_s"] = time.time() - started
        return figures

    def _start(self, spec: JobSpec, arm: Arm):
        import spotline

        arm.started = time.time()
        return spotline.Job(spec).start()

    def _rehearse(self, cluster: LocalSpotCluster) -> tuple[Arm, list[Applied], int]:
        arm = Arm("chaos")
        run = self._start(self.chaos.spec, arm)
        self._until_first_step(run, arm)
        todo = self.trace.timeline()
        # The trace numbers the nodes 0..N-1 at the start, then one more per join; a
        # reused cluster's fresh nodes may carry other numbers.
        self.numbers = dict(enumerate(cluster.live()))
        applied: list[Applied] = []
        origin = self._until_full_size(run, arm)
        end = origin + self.trace.duration_s
        while True:
            st = self._poll(run, arm)
            now = time.time()
            while todo and now >= origin + todo[0].at and not _ended(st):
                applied.append(self._apply(cluster, run, todo.pop(0), arm, st))
                st = self._poll(run, arm)
            if _ended(st) or (now >= end and not todo):
                break
            time.sleep(POLL_S)
        if not _ended(st):
            run.controller.stop.remote("the trace ended")
            while not _ended(self._poll(run, arm)):
                time.sleep(POLL_S)
        self._finish(run, arm)
        unreplayed = sum(e.kind != "gone" for e in todo)
        return arm, applied, unreplayed

    def _uninterrupted(self, steps: int) -> Arm:
        arm = Arm("reference")
        run = self._start(self.reference.spec, arm)
        if steps > 0:
            self._until_first_step(run, arm)
            while True:
                st = self._poll(run, arm)
                if _ended(st) or st["step"] >= steps:
                    break
                time.sleep(POLL_S)
            if not _ended(st):
                run.controller.stop.remote("the uninterrupted run reached the rehearsal's step")
                while not _ended(self._poll(run, arm)):
                    time.sleep(POLL_S)
        else:
            run.controller.stop.remote("the rehearsal committed no step")
        self._finish(run, arm)
        return arm

    def _until_first_step(self, run, arm: Arm) -> None:
        deadline = time.time() + START_TIMEOUT_S
        while time.time() < deadline:
            st = self._poll(run, arm)
            if st["step"] >= 1 or _ended(st):
                arm.t0 = time.time() if st["step"] >= 1 else None
                if arm.t0 is not None:
                    self.say(f"[{arm.name}] first step {arm.t0 - arm.started:.1f}s after start")
                return
            time.sleep(POLL_S)
        raise SpecError(
            f"{run.spec.name}: no training step within {START_TIMEOUT_S:.0f}s of its start; "
            "the job may be too big for this machine (try --scale-model)"
        )

    def _until_full_size(self, run, arm: Arm) -> float:
        """When the trace starts: once the job runs every rank the cluster's nodes hold
        for it (up to elastic.max_replicas), so that the trace meets the job it was
        written for and not a start that fell back to fewer replicas; at most
        FULL_SIZE_WAIT_S after its first step."""
        pp = run.spec.parallel.pipeline_stages
        fits = len(self.numbers) * self.shape.slots // pp
        want = min(run.spec.elastic.max_replicas, fits) * pp
        deadline = time.time() + FULL_SIZE_WAIT_S
        while True:
            st = self._poll(run, arm)
            ranks = len(st["workers"] or [])
            if _ended(st) or ranks >= want:
                return time.time()
            if time.time() >= deadline:
                self.say(
                    f"[{arm.name}] {ranks} of the job's {want} ranks run "
                    f"{FULL_SIZE_WAIT_S:.0f}s after its first step "
                    "(SPOTLINE_CHAOS_FULL_SIZE_WAIT_S): the trace starts now"
                )
                return time.time()
            time.sleep(POLL_S)

    def _poll(self, run, arm: Arm) -> dict[str, Any]:
        import ray

        since = getattr(arm, "_next_event", 0)
        st = ray.get(run.controller.status.remote(since))
        arm._next_event = st["next_event"]  # type: ignore[attr-defined]
        now = time.time()
        for line in st["events"]:
            arm.log.append((now, line))
            if arm.name == "chaos":
                self.say(f"[{arm.name} {self._at(arm, now)}] {line}")
        arm.samples.append(
            {
                "t": now,
                "state": st["state"],
                "step": st["step"] or 0,
                "replicas": st["replicas"] or 0,
                "committed": max(st["committed_steps"] or [0]),
                "nodes": sorted({w["node_id"] for w in st["workers"] or []}),
            }
        )
        return st

    def _at(self, arm: Arm, t: float) -> str:
        return f"{t - arm.t0:6.1f}s" if arm.t0 is not None else "start"

    def _apply(self, cluster, run, e, arm: Arm, st: dict[str, Any]) -> Applied:
        import ray

        result = ray.get(run.controller.result.remote())
        running = st["state"] == "running" and st["workers"]
        node_id = cluster.node_id(self.numbers[e.node]) if e.kind != "join" else ""
        hit = node_id in {w["node_id"] for w in st["workers"] or []}
        if e.kind == "notice":
            cluster.notice(self.numbers[e.node], e.deadline_s, then_remove=False)
        elif e.kind in ("loss", "gone"):
            cluster.lose(self.numbers[e.node], kind=e.kind)
        else:
            self.numbers[e.node] = cluster.join()
            node_id = cluster.node_id(self.numbers[e.node])
        now = time.time()
        a = Applied(
            at=now - (arm.t0 or now),
            t=now,
            kind=e.kind,
            node=e.node,
            node_id=node_id,
            deadline_s=e.deadline_s,
            step=st["step"] or 0,
            committed=max(st["committed_steps"] or [0]) or None,
            attempt=len(result["attempts"]) - 1 if running and result["attempts"] else None,
            hit=bool(hit),
            replicas=st["replicas"] or 0,
        )
        what = e.describe().split(" at ")[0]
        where = f"node {e.node}" + (" (the job's ranks were there)" if hit else "")
        self.say(f"[trace {self._at(arm, now)}] {what}: {where}")
        arm.log.append((now, f"trace: {e.describe()} ({where}; step {a.step})"))
        return a

    def _finish(self, run, arm: Arm) -> None:
        import ray

        from spotline.job_outcome import JobFailed

        with contextlib.suppress(Exception):
            arm.summary = ray.get(run.controller.summary.remote())
        try:
            result = run.wait(verbose=False, expect=("finished", "stopped"))
            arm.result = dict(result.__dict__)
        except JobFailed as e:
            arm.result = dict(e.result.__dict__)
        arm.ended = time.time()
        state = arm.result.get("state")
        last = max(arm.result.get("committed_steps") or [0])
        self.say(f"[{arm.name}] {state} at step {arm.result.get('steps')}, last commit step {last}")

    # --- the figures --------------------------------------------------------------------------

    def _figures(
        self, chaos: Arm, ref: Arm, applied: list[Applied], unreplayed: int, committed: int
    ) -> dict[str, Any]:
        res = chaos.result
        attempts = res.get("attempts") or []
        losses = {int(k): v for k, v in (res.get("losses") or {}).items()}
        ref_losses = {int(k): v for k, v in (ref.result.get("losses") or {}).items()}
        diff = first_difference(
            losses, ref_losses, committed, self.tolerance, attempts, ref.result.get("attempts")
        )
        first_restart = first_resume(attempts)
        data_pure = None
        if diff.first is not None:
            data_pure = probe_data(self.chaos.spec, diff.first)
        t_chaos, t_ref = chaos.reached(committed), ref.reached(committed)
        goodput = t_ref / t_chaos if t_chaos and t_ref else (0.0 if not committed else None)
        reports = event_reports(
            applied, attempts, res.get("notices") or [], res.get("recoveries") or [], chaos.samples
        )
        ref_rate = committed / t_ref if t_ref else None
        settings = settings_costs(
            self.chaos.spec, reports, ref_rate, res.get("peer_memory"), res.get("waited_s") or 0.0
        )
        verdict = judge(
            state=res.get("state", "failed"),
            error=res.get("error"),
            diff=diff,
            first_restart_step=first_restart,
            data_pure=data_pure,
            lost=lost_commits(attempts, applied),
            reports=reports,
            unreplayed=unreplayed,
            goodput=goodput,
            min_goodput=self.min_goodput,
            tolerance=self.tolerance,
        )
        ref_wall = ref.ended - ref.started
        return {
            **verdict.to_dict(),
            "goodput": goodput,
            "steps_lost": sum(r.steps_lost for r in reports),
            "committed_steps": committed,
            "compared_steps": diff.compared,
            "identical_steps": diff.identical,
            "replayed_steps": diff.replayed,
            "bounded_steps": diff.bounded,
            "drift_from_step": diff.drift_from,
            "unchecked_resumes": diff.unchecked,
            "max_relative_difference": diff.max_rel,
            "tolerance": self.tolerance,
            "data_pure": None if data_pure is None else data_pure[0],
            "events": [asdict(r) for r in reports],
            "unreplayed_events": unreplayed,
            "settings": settings,
            "changes": self.chaos.changes,
            "job": self.user.name,
            "spec": str(getattr(self.user, "_source", "")) or None,
            "trace": self.trace.to_dict(),
            "nodes": self.trace.nodes,
            "footprint": self.footprint.describe(),
            "chaos": _arm_figures(chaos, committed),
            "reference": _arm_figures(ref, committed),
            "reference_wall_s": ref_wall,
            "losses": {str(k): v for k, v in sorted(losses.items())},
            "reference_losses": {str(k): v for k, v in sorted(ref_losses.items())},
            "samples": chaos.samples,
            "node_log": self._node_log(chaos),
            "applied": [asdict(a) for a in applied],
            "attempts": [_attempt(a) for a in attempts],
            "log": [(t, line) for t, line in chaos.log],
            "summary": chaos.summary,
        }

    def _node_log(self, chaos: Arm) -> list[dict[str, Any]]:
        """What the cluster did to the rehearsal's nodes until it ended, numbered as the
        trace numbers them."""
        trace_number = {n: t for t, n in self.numbers.items()}
        return [
            {**e.to_dict(), "node": trace_number[e.node]}
            for e in self.cluster.log
            if e.node in trace_number and e.t <= chaos.ended
        ]


def _arm_figures(arm: Arm, committed: int) -> dict[str, Any]:
    r = arm.result
    return {
        "state": r.get("state"),
        "steps": r.get("steps"),
        "last_commit": max(r.get("committed_steps") or [0]),
        "first_step_s": (arm.t0 - arm.started) if arm.t0 else None,
        "to_last_commit_s": arm.reached(committed),
        "wall_s": arm.ended - arm.started,
        "t0": arm.t0,
        "error": r.get("error"),
        "recoveries": r.get("recoveries") or [],
        "notices": r.get("notices") or [],
        "waited_s": r.get("waited_s"),
    }


def first_resume(attempts: list[dict[str, Any]]) -> int | None:
    """The step the first group after one that trained resumed from (0: from scratch);
    None when no group followed one that trained (a failed start trains nothing)."""
    trained = False
    for a in attempts:
        if trained:
            return a.get("restored_from") or 0
        trained = bool(a.get("losses"))
    return None


def _attempt(a: dict[str, Any]) -> dict[str, Any]:
    keys = ("attempt", "replicas", "start_step", "restored_from", "restored_via", "ended_by")
    steps = [s for s, _ in a.get("losses") or []]
    return {**{k: a.get(k) for k in keys}, "last_step": max(steps) if steps else None}


def _ended(st: dict[str, Any]) -> bool:
    return st["state"] in ("finished", "failed", "stopped")


def probe_data(spec: JobSpec, step: int) -> tuple[bool, str] | None:
    """Whether the job's data gives batch `step` as a pure function of the step: drawn
    from two fresh datasets, one after drawing other steps, and twice from the same.
    (pure, what was seen); None when the data cannot be opened here."""
    import numpy as np

    from spotline.data import Sampler, open_dataset
    from spotline.preflight import user_code_on_path

    rows = spec.global_batch(spec.elastic.max_replicas)
    try:
        with user_code_on_path(spec):
            a = Sampler(open_dataset(spec).train, spec.model.seq_len, 1, spec.data.seed)
            first = a.global_rows(step, rows)
            b = Sampler(open_dataset(spec).train, spec.model.seq_len, 1, spec.data.seed)
            for other in (1, max(1, step - 1), step + 1):
                b.global_rows(other, rows)
            second = b.global_rows(step, rows)
            third = b.global_rows(step, rows)
    except Exception as e:  # noqa: BLE001 - the verdict says the probe could not run
        print(
            f"spotline chaos: could not open the job's data here to probe it: {e}", file=sys.stderr
        )
        return None
    if np.array_equal(first, second) and np.array_equal(second, third):
        return True, f"batch {step} drawn three ways was the same"
    return False, (
        f"data.kind {spec.data.kind!r} gave other tokens for step {step} when drawn again, or "
        "after drawing other steps"
    )


def run_chaos(
    spec: JobSpec,
    trace: str,
    out: Path,
    cluster: LocalSpotCluster | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Rehearse `spec` against `trace` (a built-in name or a trace file) and write the
    report directory `out`; the figures (see docs/guide/chaos.md). `cluster`: a running
    local spot cluster to use (its nodes are reset), else a new one for this call."""
    from spotline.chaos.report import write_chaos_report

    figures = Rehearsal(spec, trace, out, **options).run(cluster)
    write_chaos_report(figures, out)
    return figures
