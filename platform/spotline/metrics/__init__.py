"""Spotline's figures: Ray metrics, MFU/HFU, GPU samples, the goodput ledger.

MFU is computed once, `spotline.metrics.mfu.mfu` (the plan's prediction uses it too).
It computes and exports; it never decides anything for the job, and never imports
planning/ (per-layer FLOPs come from `spotline.models.flops`), train/, the runtime or
the controller (they hand it their numbers).
"""

from spotline.metrics.prometheus import BY_NAME, METRICS, MetricDef, Metrics

__all__ = ["BY_NAME", "METRICS", "MetricDef", "Metrics"]
