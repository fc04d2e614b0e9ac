"""`spotline chaos`: rehearse a job against a spot trace on this machine, and judge it.

The front: the trace replayer (`traces`, `cluster`), the rehearsal that runs the user's
job under a trace and again uninterrupted (`run`), what it found (`verdict`) and its
report directory (`report`). `spotline.testing` offers the same cluster to pytest.

Nothing below the front imports this package; it starts only what it stops.
"""

from spotline.chaos.cluster import LocalSpotCluster, SpotNodeShape
from spotline.chaos.traces import BUILTIN, Event, Trace, TraceError, check_trace, load_trace

__all__ = [
    "BUILTIN",
    "Event",
    "LocalSpotCluster",
    "SpotNodeShape",
    "Trace",
    "TraceError",
    "check_trace",
    "load_trace",
    "run_chaos",
]


def run_chaos(*args, **kwargs):
    """See `spotline.chaos.run.run_chaos`."""
    from spotline.chaos.run import run_chaos as run

    return run(*args, **kwargs)
