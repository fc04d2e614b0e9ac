"""Spotline's series in Ray's metrics export: Prometheus, the Ray dashboard, Grafana.

Every series is declared once, here, with its tags; code sets them through
`Metrics`, and `infra/grafana/spotline.json` may reference only these names (a
test checks it). Every series carries the job's name; per-rank ones also carry
the pipeline stage and the replica, per-device ones the GPU index.

Ray exports them from the process that sets them (the controller on the head
node, each worker on its own node), through that node's metrics agent.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("spotline.metrics")

JOB = ("job",)
RANK = ("job", "stage", "replica")
GPU = ("job", "stage", "replica", "gpu")


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: str  # "gauge" or "counter"
    description: str
    tags: tuple[str, ...] = JOB


METRICS: tuple[MetricDef, ...] = (
    # Progress and speed.
    MetricDef("spotline_step", "gauge", "Optimizer steps done by the live group."),
    MetricDef("spotline_target_steps", "gauge", "Steps the job trains in all (train.steps)."),
    MetricDef("spotline_step_seconds", "gauge", "Mean seconds per step of the last chunk."),
    MetricDef("spotline_tokens_per_second", "gauge", "Training tokens per second, all replicas."),
    MetricDef("spotline_train_loss", "gauge", "Training loss of the latest step."),
    MetricDef("spotline_eval_loss", "gauge", "Held-out loss of the latest evaluated checkpoint."),
    MetricDef(
        "spotline_eval_weights_step", "gauge", "Step of the weights spotline_eval_loss is of."
    ),
    MetricDef("spotline_learning_rate", "gauge", "Learning rate of the latest step."),
    MetricDef(
        "spotline_data_stall_fraction",
        "gauge",
        "Share of the latest chunk's time its steps waited for their batches.",
    ),
    MetricDef("spotline_mfu", "gauge", "Model FLOPs utilisation: model FLOP/s / peak FLOP/s."),
    MetricDef("spotline_hfu", "gauge", "Hardware FLOPs utilisation (counts recomputation)."),
    # Pipeline bubbles and backfill.
    MetricDef(
        "spotline_bubble_fraction",
        "gauge",
        "Share of the step a stage waited on other stages (last chunk).",
        RANK,
    ),
    MetricDef("spotline_bubble_theory", "gauge", "The 1F1B bubble (p-1)/(m+p-1) at the current m."),
    MetricDef(
        "spotline_fill_fraction",
        "gauge",
        "Share of a stage's bubble windows its backfill executor was busy in (last chunk).",
        RANK,
    ),
    MetricDef(
        "spotline_backfill_overrun_fraction",
        "gauge",
        "Share of a stage's step its backfill executor was busy outside windows (last chunk).",
        RANK,
    ),
    MetricDef(
        "spotline_backfill_slowdown",
        "gauge",
        "Training step time with backfill on over the paused baseline, minus 1.",
    ),
    MetricDef("spotline_backfill_tasks_total", "counter", "Backfill tasks ended.", (*JOB, "state")),
    # Checkpoints.
    MetricDef(
        "spotline_checkpoint_save_seconds", "gauge", "Seconds the last save blocked training."
    ),
    MetricDef(
        "spotline_checkpoint_upload_seconds",
        "gauge",
        "Seconds the last checkpoint's uploads took (background).",
    ),
    MetricDef("spotline_checkpoint_bytes", "gauge", "Bytes of the last committed checkpoint."),
    MetricDef("spotline_checkpoint_step", "gauge", "Step of the last committed checkpoint."),
    # Spot capacity.
    MetricDef("spotline_preemption_notices_total", "counter", "Preemption notices received."),
    MetricDef("spotline_node_losses_total", "counter", "Nodes lost without notice."),
    MetricDef("spotline_restarts_total", "counter", "Worker group restarts.", (*JOB, "why")),
    MetricDef("spotline_replicas", "gauge", "Data-parallel replicas alive."),
    MetricDef("spotline_global_batch_size", "gauge", "Sequences per step now in force."),
    MetricDef(
        "spotline_gradient_noise_scale",
        "gauge",
        "Estimated simple gradient noise scale B_simple (sequences; adaptive batch only).",
    ),
    MetricDef("spotline_replicas_max", "gauge", "elastic.max_replicas."),
    # Goodput and cost.
    MetricDef(
        "spotline_goodput_device_seconds",
        "gauge",
        "Device-seconds of the job by where they went.",
        (*JOB, "part"),
    ),
    MetricDef(
        "spotline_goodput_fraction", "gauge", "Useful training compute / all device-seconds."
    ),
    MetricDef(
        "spotline_cost_dollars",
        "gauge",
        "What the job cost on spot, and what its steps would cost on-demand.",
        (*JOB, "pricing"),
    ),
    MetricDef(
        "spotline_deviation_alerts_total",
        "counter",
        "Sustained deviations of step time or tokens/s from the baseline.",
        (*JOB, "cause"),
    ),
    # Hangs, stragglers and cordoned nodes.
    MetricDef(
        "spotline_heartbeat_age_seconds",
        "gauge",
        "Seconds since a rank last answered the controller's poll (its heartbeat's age).",
        RANK,
    ),
    MetricDef(
        "spotline_rank_compute_seconds",
        "gauge",
        "A rank's own compute per step (no collective, no pipeline transfer), over a window.",
        RANK,
    ),
    MetricDef(
        "spotline_rank_slowdown",
        "gauge",
        "How much slower a straggling rank computes than its peers (0 when it is not one).",
        RANK,
    ),
    MetricDef("spotline_hangs_total", "counter", "Hangs declared (no step within the bound)."),
    MetricDef("spotline_stragglers_total", "counter", "Ranks reported as stragglers."),
    MetricDef("spotline_cordoned_nodes", "gauge", "Nodes kept out of new groups."),
    # Experiment trackers (TensorBoard, MLflow, wandb): never a reason to stop training.
    MetricDef(
        "spotline_tracker_errors_total",
        "counter",
        "Tracker calls that raised (server down, disk full); training went on.",
        (*JOB, "tracker"),
    ),
    MetricDef(
        "spotline_tracker_dropped_total",
        "counter",
        "Tracker updates dropped because a slow tracker let its queue fill up.",
        (*JOB, "tracker"),
    ),
    # Devices (pynvml; absent on machines without NVIDIA GPUs).
    MetricDef("spotline_gpu_utilization_percent", "gauge", "GPU utilisation.", GPU),
    MetricDef("spotline_gpu_memory_used_bytes", "gauge", "GPU memory in use.", GPU),
    MetricDef("spotline_gpu_sm_clock_mhz", "gauge", "GPU SM clock.", GPU),
    MetricDef("spotline_gpu_power_watts", "gauge", "GPU power draw.", GPU),
)
BY_NAME = {m.name: m for m in METRICS}


def exported_name(name: str) -> str:
    """The series name Prometheus sees: Ray puts its "ray_" namespace in front (and
    counters, already named *_total, keep their name)."""
    return f"ray_{BY_NAME[name].name}"


class Metrics:
    """The job's series in this process. Never raises: metrics must not stop training."""

    def __init__(self, job: str):
        self.job = job
        self._objs: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._warned = False

    def _obj(self, name: str) -> Any:
        with self._lock:
            if name not in self._objs:
                from ray.util import metrics as rm

                d = BY_NAME[name]
                cls = rm.Gauge if d.kind == "gauge" else rm.Counter
                self._objs[name] = cls(d.name, description=d.description, tag_keys=d.tags)
            return self._objs[name]

    def _tags(self, name: str, tags: dict[str, Any]) -> dict[str, str]:
        keys = BY_NAME[name].tags
        return {k: str(self.job if k == "job" else tags[k]) for k in keys}

    def set(self, name: str, value: float | None, **tags: Any) -> None:
        if value is None:
            return
        self._safely(lambda: self._obj(name).set(float(value), tags=self._tags(name, tags)))

    def inc(self, name: str, value: float = 1.0, **tags: Any) -> None:
        if value <= 0:
            return
        self._safely(lambda: self._obj(name).inc(float(value), tags=self._tags(name, tags)))

    def _safely(self, fn) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a metric must never break a job
            if not self._warned:
                self._warned = True
                log.warning("Spotline metrics are not exported from this process: %s", e)


def export_gpu_samples(metrics: Metrics, stage: int, replica: int, local_index: int | None) -> None:
    """pynvml figures of the GPU this rank drives (cuda:`local_index`), tagged with its
    node index; nothing for a rank that drives none (`local_index` None) and nothing
    at all without NVIDIA GPUs."""
    from spotline.metrics.gpu import gpu_samples

    if local_index is None:
        return
    for s in gpu_samples(local_index):
        tags = {"stage": stage, "replica": replica, "gpu": s["index"]}
        metrics.set("spotline_gpu_utilization_percent", s.get("utilization_pct"), **tags)
        metrics.set("spotline_gpu_memory_used_bytes", s.get("memory_used_bytes"), **tags)
        metrics.set("spotline_gpu_sm_clock_mhz", s.get("sm_clock_mhz"), **tags)
        metrics.set("spotline_gpu_power_watts", s.get("power_w"), **tags)
