"""Spotline's figures: Ray metrics, MFU/HFU, GPU samples, the goodput ledger.

MFU is computed once, `spotline.metrics.flops.mfu` (the plan's prediction uses it too).
metrics/ measures and reports from config/ and models/ alone: it never imports
planning/ (per-layer FLOPs come from `spotline.models.flops`), train/, runtime/ or
controller/.
"""

from spotline.metrics.export import BY_NAME, METRICS, MetricDef, Metrics

__all__ = ["BY_NAME", "METRICS", "MetricDef", "Metrics"]
