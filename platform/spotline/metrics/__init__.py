"""Spotline's figures: Ray metrics, MFU/HFU, GPU samples, the goodput ledger.

It computes and exports; it never decides anything for the job, and never imports the
runtime or the controller (they hand it their numbers)."""

from spotline.metrics.export import BY_NAME, METRICS, MetricDef, Metrics

__all__ = ["BY_NAME", "METRICS", "MetricDef", "Metrics"]
