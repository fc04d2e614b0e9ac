"""Spotline's figures: Ray metrics, MFU/HFU, GPU samples, the goodput ledger."""

from spotline.metrics.export import BY_NAME, METRICS, MetricDef, Metrics

__all__ = ["BY_NAME", "METRICS", "MetricDef", "Metrics"]
