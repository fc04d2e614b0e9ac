"""The controller's figures: the ranks' progress taken in, the goodput ledger, Ray
metrics, MFU, deviation alerts, and the job's run in the experiment trackers of
`tracking:`.

Kept out of the state machine: the controller hands it what the ranks reported (a
batch of steps, their figures, a commit, an event) and it keeps the record's figures
(losses, tokens, step times, peak memory, the batch), the pace (`pace.Pace`), the
ledger's accounting of every device-second, and the exporting. It decides nothing.
Nothing here may stop a job: metric export never raises, and trackers write from
their own threads.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from spotline.checkpoint import (
    LEDGER_ARTIFACT,
    SUMMARY_ARTIFACT,
)
from spotline.config.schema import JobSpec
from spotline.controller.pace import Pace
from spotline.controller.snapshot import Figures
from spotline.controller.state import (
    Finishing,
    Leaving,
    Pending,
    Running,
    Scheduling,
    Starting,
    State,
    Waiting,
)
from spotline.metrics.deviation import DeviationMonitor, likely_cause
from spotline.metrics.ledger import GoodputLedger
from spotline.metrics.mfu import hardware_flops_per_token, mfu, model_flops_per_token
from spotline.metrics.prometheus import Metrics
from spotline.metrics.trackers import Trackers


class Telemetry:
    def __init__(
        self,
        spec: JobSpec,
        event,
        wall: Callable[[], float],
        checkpoint_uri: str | None = None,
    ):
        self.spec = spec
        self.fig = Figures()
        """What the ranks' progress measured: written here alone."""
        self.wall = wall  # the controller's wall clock (`clock.Clock.wall`)
        self.pace = Pace()
        self.world = 0  # the latest group's world size
        self._accounted = 0.0  # seconds of this iteration charged from the ranks' figures
        self._event = event
        self.metrics = Metrics(spec.name)
        self.trackers = Trackers(
            spec,
            checkpoint_uri or spec.resolved_checkpoint_uri(),
            self.metrics,
            warn=lambda text: event(text, logging.WARNING),
        )
        # The latest step whose training figures went to the trackers: steps trained
        # again after a restart are not sent twice.
        self._tracked_step = 0
        self.ledger = GoodputLedger()
        m = spec.metrics
        self.deviation = DeviationMonitor(
            m.deviation_threshold,
            m.deviation_sustain_steps,
            m.deviation_warmup_steps,
            m.deviation_baseline_steps,
        )
        self.flops_per_token = model_flops_per_token(spec)
        # Blocks recomputed in the backward run their forward twice (HFU counts it).
        self.hardware_flops_per_token = hardware_flops_per_token(spec)
        self.peak_flops: float | None = None  # per device, from the workers
        self.history: list[dict[str, Any]] = []  # one row per chunk
        self.evals: list[dict[str, Any]] = []
        self.last: dict[str, Any] = {}
        self._exported: Counter = Counter()  # counters already exported, by key

    # --- progress ingest -------------------------------------------------------------

    def take_steps(self, p, replicas: int, now: float) -> None:
        """The steps and saves a poll reported, into the figures (tokens, step times,
        blocked seconds) and the pace; the first steps after a restart end it."""
        f = self.fig
        if p.batch is not None:
            f.batch = p.batch
        for step, _, step_s, wall in p.steps:
            f.tokens_trained += self.batch_at(step, replicas) * self.spec.model.seq_len
            f.step_seconds.append(step_s)
            self.pace.recent.append((step, wall))
            if f.first_step_start is None:
                f.first_step_start = wall - step_s
            f.last_step_end = wall
        if p.steps:
            f.steps_trained += len(p.steps)
            restart = self.pace.stepped(now)
            if restart is not None:
                why, seconds = restart
                f.recoveries.append(
                    {
                        "why": why,
                        "seconds": seconds,
                        "resumed_at_step": p.steps[-1][0],
                        "resumed_at": self.wall(),
                    }
                )
                self._event(f"training again {seconds:.1f}s after the {why}", track="recovery")
        f.blocked_s.extend(blocked for _, blocked in sorted(p.saves.items()))

    def take_memory(self, p, replicas: int) -> None:
        """Peak memory per stage, of the first group only: the plan is compared at one
        shape."""
        f = self.fig
        for m in p.memory:
            if f.peak_memory_replicas not in (None, replicas):
                continue
            f.peak_memory_replicas = replicas
            f.peak_memory[m["stage"]] = max(f.peak_memory.get(m["stage"], 0), m["peak_bytes"])

    def account(
        self, p, elapsed: float, group, now: float, book, backfill, partitions, start_step: int
    ) -> None:
        """Figures of a poll of `group`: the pipeline's bubbles (`book`, None at pp=1) and
        each stage's compute time (to `partitions`), the chunk that paces `backfill`
        (None: off), the exported figures; the ledger gets the devices' wall time of
        the poll (`elapsed`), split into what the steps measured and the rest."""
        replicas, world = group.replicas, group.world_size
        steps = [(s, loss) for s, loss, _, _ in p.steps]
        step_time = sum(st for _, _, st, _ in p.steps)
        blocked = sum(p.saves.values())
        warm = now - self.pace.group_started > 1.0 and len(p.steps) > 0
        if book is not None and p.bubbles:
            on = backfill is not None and not backfill.governor.decision().paused
            # The depth in force: an adaptive batch deepens the 1F1B schedule as it grows.
            micro = (self.fig.batch or {}).get("micro_batches")
            book.add(p.bubbles, micro or self.spec.grad_accum(replicas), on)
            if p.steps and p.steps[0][0] > start_step + 1:
                # A group's first step allocates and warms up: not the stages' pace.
                partitions.measure(p.bubbles, p.steps[-1][0])
        if backfill is not None:
            if p.steps:
                backfill.on_chunk(len(p.steps), step_time, warm=warm)
            backfill.poll()
        if p.steps:
            self.pace.note_rate(replicas, len(p.steps) / max(step_time, 1e-9), warm)
        self.steps(
            steps=steps,
            seconds=step_time,
            replicas=replicas,
            world=world,
            bubbles=book.last_chunk if book is not None else None,
            per_rank=p.bubbles,
            lr=p.lr,
            tokens=sum(self.batch_at(s, replicas) for s, _ in steps) * self.spec.model.seq_len,
            batch=self.batch_view(steps[-1][0], replicas) if steps else None,
            backfill_slowdown=backfill.governor.slowdown if backfill is not None else None,
            data_stall_s=p.data_stall_s,
            warm=warm,
            uploading=p.uploading,
        )
        # The devices ran the whole time: what the steps and saves did not cover is
        # waiting for the slowest rank, the step agreement, and publishing progress.
        wall = max(elapsed, step_time + blocked)
        self.ledger.charge("checkpoint_stall", blocked, world)
        self.ledger.charge("startup_other", wall - step_time - blocked, world)
        self._accounted += elapsed
        self._report_progress(p, replicas)

    def begin_iteration(self) -> None:
        self._accounted = 0.0

    def charge_iteration(self, state: State, seconds: float) -> None:
        """Every iteration's device-seconds go to the ledger: what the ranks measured
        (see `account`), and the rest to the part of the state it was spent in."""
        part = {Pending: "startup_other", Waiting: "waiting"}.get(type(state), "recovery")
        if isinstance(state, (Running, Leaving, Finishing)):
            part = "startup_other"  # the final evaluation, a gap between two polls
        elif isinstance(state, (Scheduling, Starting)) and state.reason == "start":
            part = "startup_other"
        rest = max(0.0, seconds - self._accounted)
        self.ledger.charge(part, rest, self.world)

    def _report_progress(self, p, replicas: int) -> None:
        t = self.spec.train
        for step, loss, step_s, _ in p.steps:
            if step % t.log_every == 0 or step >= t.steps:
                sps = 1.0 / step_s if step_s else 0.0
                tok = sps * self.batch_at(step, replicas) * self.spec.model.seq_len
                self._event(
                    f"step {step}/{t.steps}  loss {loss:.4f}  {sps:.2f} steps/s  {tok:,.0f} tokens/s"
                )

    def batch_at(self, step: int, replicas: int | None) -> int:
        """Sequences step `step` trained on: the adaptive schedule's history as the ranks
        reported it, else what the batch policy gives the live group (`replicas`)."""
        hist = (self.fig.batch or {}).get("history")
        if self.spec.train.batch_schedule == "adaptive" and hist:
            return next((size for first, size in reversed(hist) if first <= step), hist[0][1])
        return self.spec.global_batch(replicas or self.spec.elastic.max_replicas)

    def batch_view(self, step: int, replicas: int | None) -> dict[str, Any]:
        """The batch of `step`, for status and metrics: schedule, global_batch_size,
        noise_scale, history."""
        b = self.fig.batch or {}
        return {
            "schedule": self.spec.train.batch_schedule,
            "global_batch_size": self.batch_at(step, replicas),
            "noise_scale": b.get("noise_scale"),
            "history": b.get("history") or [[1, self.batch_at(1, replicas)]],
        }

    # --- loading and storing ------------------------------------------------------

    def resume(self, artifacts) -> None:
        """Continue the ledger and history a previous controller of this job stored
        (`artifacts.read_artifact`: the commit coordinator)."""
        ledger = artifacts.read_artifact(LEDGER_ARTIFACT)
        summary = artifacts.read_artifact(SUMMARY_ARTIFACT)
        if ledger is None:
            return
        self.ledger = GoodputLedger.from_dict(json.loads(ledger))
        if summary is not None:
            saved = json.loads(summary)
            self.history = saved.get("history", [])
            self.evals = saved.get("evals", [])
        self._event(
            f"continuing the goodput ledger of this job: {self.ledger.total_s / 3600:.3f} "
            "device-hours so far"
        )

    # --- the trackers -----------------------------------------------------------------

    def start_tracking(self, resumed_step: int | None) -> None:
        """Open (or continue) the job's run in every tracker, once: when the first group
        restored, from committed step `resumed_step` (None: a fresh start)."""
        if self.trackers.started:
            return
        self._tracked_step = resumed_step or 0
        self.trackers.start(self.spec.model_dump(mode="json"), resumed_step)

    def event(self, step: int, kind: str, text: str) -> None:
        """Something the controller did or saw at `step`, for the trackers."""
        self.trackers.event(step, kind, text)

    def heldout(self, step: int, loss: float | None) -> None:
        """The final held-out loss (train.eval_batches batches) at the last step."""
        self.trackers.metrics(step, {"eval/heldout_loss": loss})

    def close(self, state: str) -> None:
        """The job ended in `state` (finished, failed, stopped): end the trackers' run."""
        self.trackers.close(state)

    def _track_steps(self, steps: list[tuple[int, float]], figures: dict[str, float | None]):
        """The loss of every step on a train.log_every boundary (and the last step), the
        batch's figures with the latest of them."""
        t = self.spec.train
        due = [
            (s, loss)
            for s, loss in steps
            if s > self._tracked_step and (s % t.log_every == 0 or s >= t.steps)
        ]
        if not due:
            return
        for s, loss in due[:-1]:
            self.trackers.metrics(s, {"train/loss": loss})
        step, loss = due[-1]
        ledger = self.ledger
        parts = {
            f"goodput/{part}": v / ledger.total_s if ledger.total_s else None
            for part, v in ledger.device_s.items()
        }
        self.trackers.metrics(
            step, {"train/loss": loss, **figures, "goodput/fraction": ledger.goodput(), **parts}
        )
        self._tracked_step = step

    # --- figures ----------------------------------------------------------------------

    def steps(
        self,
        *,
        steps: list[tuple[int, float]],
        seconds: float,
        replicas: int,
        world: int,
        bubbles: dict[str, Any] | None,
        per_rank: list[dict[str, Any]],
        lr: float | None,
        backfill_slowdown: float | None,
        warm: bool,
        uploading: bool = False,
        data_stall_s: float = 0.0,
        tokens: int | None = None,
        batch: dict[str, Any] | None = None,
    ) -> None:
        """A batch of steps the ranks reported (`seconds`: their summed step times;
        `tokens`: what they trained on, by default the batch policy's; `batch`: the
        batch in force, global_batch_size and noise_scale)."""
        done = len(steps)
        if not done:
            return
        spec = self.spec
        if tokens is None:
            tokens = done * spec.global_batch(replicas) * spec.model.seq_len
        b_now = batch or {}
        b = bubbles or {}
        self.ledger.train(
            seconds,
            world,
            done,
            b.get("bubble_fraction", 0.0),
            b.get("bubble_fill_fraction", 0.0),  # the ledger splits the whole bubble
            data_stall_s,
        )
        tps = tokens / seconds if seconds else 0.0
        util = mfu(tps, self.flops_per_token, world, self.peak_flops) if self.peak_flops else None
        hutil = (
            mfu(tps, self.hardware_flops_per_token, world, self.peak_flops)
            if self.peak_flops
            else None
        )
        step, loss = steps[-1]
        self.last = {
            "step_s": seconds / done,
            "data_stall_fraction": data_stall_s / seconds if seconds else 0.0,
            "tokens_per_s": tps,
            "train_loss": loss,
            "lr": lr,
            "mfu": util,
            "hfu": hutil,
            "global_batch_size": b_now.get("global_batch_size", spec.global_batch(replicas)),
            "noise_scale": b_now.get("noise_scale"),
        }
        self.history.append({"step": step, "t": self.wall(), "replicas": replicas, **self.last})
        m = self.metrics
        m.set("spotline_step", step)
        m.set("spotline_target_steps", spec.train.steps)
        m.set("spotline_step_seconds", seconds / done)
        m.set("spotline_tokens_per_second", tps)
        m.set("spotline_train_loss", loss)
        m.set("spotline_learning_rate", lr)
        m.set("spotline_data_stall_fraction", self.last["data_stall_fraction"])
        m.set("spotline_mfu", util)
        m.set("spotline_hfu", hutil)
        m.set("spotline_global_batch_size", self.last["global_batch_size"])
        m.set("spotline_gradient_noise_scale", self.last["noise_scale"])
        m.set("spotline_replicas", replicas)
        m.set("spotline_replicas_max", spec.elastic.max_replicas)
        if b:
            m.set("spotline_bubble_theory", b.get("theory"))
        for r in per_rank:
            tags = {"stage": r["stage"], "replica": r["replica"]}
            frac = r["wait_s"] / r["step_s"] if r.get("step_s") else 0.0
            m.set("spotline_bubble_fraction", frac, **tags)
            fill = r.get("filled_s", 0.0) / r["window_s"] if r.get("window_s") else 0.0
            m.set("spotline_fill_fraction", fill, **tags)
            over = r.get("overrun_s", 0.0) / r["step_s"] if r.get("step_s") else 0.0
            m.set("spotline_backfill_overrun_fraction", over, **tags)
        m.set("spotline_backfill_slowdown", backfill_slowdown)
        if warm:
            self._check_deviation(
                done, seconds, tokens, replicas, per_rank, backfill_slowdown, uploading
            )
        self._export_ledger()
        if self.trackers:
            self._track_steps(
                steps,
                {
                    "train/lr": lr,
                    "train/tokens_per_s": tps,
                    "train/mfu": util,
                    "train/step_s": seconds / done,
                    "train/data_stall_fraction": self.last["data_stall_fraction"],
                    "train/global_batch_size": self.last["global_batch_size"],
                    "train/noise_scale": self.last["noise_scale"],
                    "train/replicas": replicas,
                    "pipeline/bubble_fraction": b.get("bubble_fraction"),
                    "pipeline/fill_fraction": b.get("fill_fraction"),
                    "pipeline/overrun_fraction": b.get("overrun_fraction"),
                    "pipeline/bubble_theory": b.get("theory"),
                    "backfill/slowdown": backfill_slowdown,
                },
            )

    def _check_deviation(
        self, done, seconds, tokens, replicas, per_rank, slowdown, uploading
    ) -> None:
        compute: dict[int, float] = {}
        for r in per_rank:
            if r.get("steps"):
                compute[r["stage"]] = max(
                    compute.get(r["stage"], 0.0), (r["step_s"] - r["wait_s"]) / r["steps"]
                )
        max_slow = self.spec.backfill.max_slowdown if self.spec.backfill.enabled else None
        cause = likely_cause(slowdown, max_slow, compute, uploading)
        for alert in self.deviation.observe(done, seconds, tokens, replicas, cause):
            self._event(f"performance alert: {alert.message()}", logging.WARNING)
            self.trackers.event(self._tracked_step, "alert", alert.message())
            self.metrics.inc("spotline_deviation_alerts_total", cause=_cause_key(alert.cause))

    def commit(self, step: int, nbytes: int, upload_s: float | None) -> None:
        """A committed step: its bytes and upload time into the figures, and out."""
        self.fig.upload_bytes.append(nbytes)
        if upload_s is not None:
            self.fig.upload_s.append(upload_s)
        blocked_s = self.fig.blocked_s[-1] if self.fig.blocked_s else None
        m = self.metrics
        m.set("spotline_checkpoint_step", step)
        m.set("spotline_checkpoint_bytes", nbytes)
        m.set("spotline_checkpoint_save_seconds", blocked_s)
        m.set("spotline_checkpoint_upload_seconds", upload_s)
        if self.trackers:
            self.trackers.metrics(
                step,
                {
                    "checkpoint/bytes": nbytes,
                    "checkpoint/save_blocked_s": blocked_s,
                    "checkpoint/upload_s": upload_s,
                },
            )
            self.trackers.event(step, "checkpoint", f"committed step {step} ({nbytes:,} bytes)")

    def backfill_result(self, result: dict[str, Any]) -> None:
        """A backfill task's result: an eval's loss; a speculative run's acceptance and
        speed."""
        if result.get("kind") == "eval":
            self.eval_result(result)
        elif result.get("kind") == "speculative":
            self.trackers.metrics(
                result["step"],
                {
                    f"speculative/{k}": result.get(k)
                    for k in (
                        "acceptance_rate",
                        "accepted_per_verification",
                        "tokens_per_s",
                        "speedup",
                    )
                },
            )

    def eval_result(self, result: dict[str, Any]) -> None:
        self.evals.append({"step": result["step"], "loss": result["loss"]})
        self.metrics.set("spotline_eval_loss", result["loss"])
        self.metrics.set("spotline_eval_weights_step", result["step"])
        self.trackers.metrics(
            result["step"],
            {"eval/loss": result["loss"], "eval/perplexity": result.get("perplexity")},
        )

    def counts(self, notices: int, node_losses: int, restarts: dict[str, int], tasks: dict):
        """Export the controller's running counts as counters (only what is new)."""
        self._count("spotline_preemption_notices_total", notices)
        self._count("spotline_node_losses_total", node_losses)
        for why, n in restarts.items():
            self._count("spotline_restarts_total", n, why=why)
        for state, n in tasks.items():
            self._count("spotline_backfill_tasks_total", n, state=state)

    def export_counts(self, tasks: dict[str, int], rec, notices: int) -> None:
        """The record's counts (`notices`, node losses, restarts by why) and the backfill
        tasks finished (`tasks`, by state), as counters."""
        restarts: dict[str, int] = {}
        for a in rec.attempts[:-1]:
            why = (a.ended_by or "unknown").replace(" ", "_")
            restarts[why] = restarts.get(why, 0) + 1
        self.counts(notices, rec.node_losses, restarts, tasks)

    def _count(self, name: str, total: int, **tags: Any) -> None:
        key = (name, *sorted(tags.items()))
        new = total - self._exported[key]
        if new > 0:
            self.metrics.inc(name, new, **tags)
            self._exported[key] = total

    def _export_ledger(self) -> None:
        for part, v in self.ledger.device_s.items():
            self.metrics.set("spotline_goodput_device_seconds", v, part=part)
        self.metrics.set("spotline_goodput_fraction", self.ledger.goodput())
        cost = self.cost()
        self.metrics.set("spotline_cost_dollars", cost["spot"], pricing="spot")
        self.metrics.set("spotline_cost_dollars", cost["on_demand_same_steps"], pricing="on_demand")

    def cost(self) -> dict[str, float | None]:
        m = self.spec.metrics
        return self.ledger.cost(m.spot_usd_per_device_hour, m.on_demand_usd_per_device_hour)

    def ledger_summary(self) -> dict[str, Any]:
        return {**self.ledger.to_dict(), "goodput": self.ledger.goodput()}


def _cause_key(cause: str) -> str:
    for prefix, key in (
        ("fewer replicas", "fewer_replicas"),
        ("backfill", "backfill"),
        ("a slow stage", "slow_stage"),
        ("checkpoint uploads", "checkpoint_upload"),
    ):
        if cause.startswith(prefix):
            return key
    return "unknown"
