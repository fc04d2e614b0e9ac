"""The per-job controller: a state machine, its policies, its inbox, and its Ray actor."""

from spotline.controller.controller import Attempt, Controller
from spotline.controller.policies import (
    Fail,
    FailurePolicy,
    GrowPolicy,
    JitPolicy,
    Resize,
    Restart,
    ScalingPolicy,
    Wait,
)

__all__ = [
    "Attempt",
    "Controller",
    "Fail",
    "FailurePolicy",
    "GrowPolicy",
    "JitPolicy",
    "Resize",
    "Restart",
    "ScalingPolicy",
    "Wait",
]
