"""Pipeline bubbles: where each stage of a 1F1B step idles, measured and forecast.

Timing only: it never decides what runs in a window (backfill does), never waits on a
device from the training step's thread, and imports nothing above config/."""

from spotline.bubbles.channel import WindowChannel
from spotline.bubbles.detector import Forecast, Window, bubble_fraction, windows
from spotline.bubbles.recorder import StepRecorder
from spotline.bubbles.schedule import (
    COMM,
    COMPUTE,
    WAITS,
    Instr,
    compute_gaps,
    idle_slots,
    program,
    simulate,
    theory_fraction,
)

__all__ = [
    "COMM",
    "COMPUTE",
    "WAITS",
    "Forecast",
    "Instr",
    "StepRecorder",
    "Window",
    "WindowChannel",
    "bubble_fraction",
    "compute_gaps",
    "idle_slots",
    "program",
    "simulate",
    "theory_fraction",
    "windows",
]
