"""The controller's figures: Ray metrics, the goodput ledger, MFU, deviation alerts, and
the job's run in the experiment trackers of `tracking:`.

Kept out of the state machine: the controller tells it what happened (a batch of
steps the ranks reported, a commit, an event) and it does the accounting and the
exporting. Nothing here may stop a job: metric export never raises, and trackers
write from their own threads.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from typing import Any

from spotline.checkpoint import (
    LEDGER_ARTIFACT,
    SUMMARY_ARTIFACT,
)
from spotline.config.schema import JobSpec
from spotline.metrics.deviation import DeviationMonitor, likely_cause
from spotline.metrics.export import Metrics
from spotline.metrics.flops import hardware_flops_per_token, mfu, model_flops_per_token
from spotline.metrics.ledger import GoodputLedger
from spotline.metrics.trackers import Trackers


class Telemetry:
    def __init__(self, spec: JobSpec, event, checkpoint_uri: str | None = None):
        self.spec = spec
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
        self.history.append({"step": step, "t": time.time(), "replicas": replicas, **self.last})
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

    def commit(self, step: int, nbytes: int, blocked_s: float | None, upload_s: float | None):
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
