"""The per-job controller: a state machine, its policies, and its Ray actor."""

from spotline.controller.controller import Attempt, CheckpointMismatchError, Controller
from spotline.controller.policies import Fail, FailurePolicy, Resize, Restart, ScalingPolicy, Wait
from spotline.controller.state import State

__all__ = [
    "Attempt",
    "CheckpointMismatchError",
    "Controller",
    "Fail",
    "FailurePolicy",
    "Resize",
    "Restart",
    "ScalingPolicy",
    "State",
    "Wait",
]
