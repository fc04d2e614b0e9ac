"""Figures as a user reads them in messages, logs and plans."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """1.2 GB, 340.0 MB, 12.0 kB: decimal units, one decimal."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"
