"""SIGTERM and Ctrl-C to a driver: the job stops at its next step boundary, then it ends.

Kubernetes (a pod deleted), `ray job stop` and batch schedulers ask a driver to go with
SIGTERM; a person at a terminal with Ctrl-C. The first one while a job runs in this
driver asks the job to stop at its next step boundary with a commit there
(`JobRun.stop_soon`), for at most SPOTLINE_DRIVER_STOP_GRACE_S; the command then exits
143 (SIGTERM) or 130 (Ctrl-C) with a line naming the step it committed, and the stored
status says `stopped` at that step. Any other one ends the command at once, as a
KeyboardInterrupt, so that every cleanup still runs (Ray's local cluster is shut down
at exit); after that a third SIGTERM is not caught at all.

From the moment the driver starts the job's controller (`starting`) until the run is
handed over (`started`), a first signal is kept and handed to the run as its stop, so
no signal in that window ends the driver with a job running and nothing committed.
Before that window nothing runs on the cluster: a signal ends the command at once, and
its line says that nothing was committed.

The front's only: it lives in the driver's main thread and never reaches the cluster
itself (the JobRun does).
"""

from __future__ import annotations

import signal
import threading
from typing import TYPE_CHECKING, Any

from spotline import constants
from spotline.job_outcome import resume_hint

if TYPE_CHECKING:
    from spotline.job_outcome import JobResult

SIGNALS = {signal.SIGTERM: ("SIGTERM", 143), signal.SIGINT: ("Ctrl-C", 130)}
"""What each signal is called in messages, and the exit code of a command it ends."""


class Interrupts:
    """This driver's handler of SIGTERM and Ctrl-C (see the module)."""

    def __init__(self) -> None:
        self.run: Any = None
        """The job running in this driver (a `JobRun`), once its controller started."""
        self.seen: list[int] = []
        self.starting = False
        """The job's controller is being started: a first signal waits for the run."""
        self.for_job = False
        """This command runs a job (`spotline run`), so its line says what was committed."""
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Handle both signals from now on (only the main thread may)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self.seen, self.run, self.starting, self.for_job = [], None, False, False
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self.handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def handle(self, signum: int, frame: Any = None) -> None:
        self.seen.append(signum)
        name = SIGNALS[signum][0]
        if len(self.seen) == 1 and self.run is not None:
            self._stop(self.run)
            return
        if len(self.seen) == 1 and self.starting:
            return  # the run's stop, once it exists (`started`)
        if signum == signal.SIGTERM:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # one more ends the process
        raise KeyboardInterrupt(name)

    def starting_job(self) -> None:
        """The driver is about to start the job's controller: from now on a first
        signal is the run's stop, kept until `started` hands it over."""
        self.starting = True

    def started(self, run: Any) -> None:
        """The job's controller runs `run`: a signal that came while it started is its
        stop now."""
        self.run, self.starting = run, False
        if len(self.seen) == 1:
            self._stop(run)

    def _stop(self, run: Any) -> None:
        name = SIGNALS[self.seen[0]][0]
        run.stop_soon(f"{name} to the driver", constants.SPOTLINE_DRIVER_STOP_GRACE_S)

    @property
    def code(self) -> int:
        """The exit code for the signal that ended the command (Ctrl-C's without one:
        a KeyboardInterrupt that reached the command some other way)."""
        return SIGNALS[self.seen[-1]][1] if self.seen else 130

    def ended_at_once(self) -> str:
        """The line for a command that a signal ended at once."""
        last = self.seen[-1] if self.seen else signal.SIGINT
        how = "terminated by SIGTERM" if last == signal.SIGTERM else "interrupted"
        again = " again" if len(self.seen) > 1 else ""
        if self.run is None:  # no job ran in this driver
            return f"{how}{again} before the job started: nothing was committed" if (
                self.for_job) else how  # fmt: skip
        return f"{how}{again}: the job was ended at once; {self.run.resume_hint()}"

    def stopped(self, result: JobResult) -> str:
        """The line for a job that ended STOPPED on this driver's signal."""
        name = SIGNALS[self.seen[0]][0] if self.seen else "a stop request"
        step = result.steps
        if step in result.committed_steps:
            return (
                f"stopped by {name} at step {step}, committed at "
                f"{result.checkpoint_uri}/step_{step:08d}: running the job again resumes there"
            )
        latest = max(result.committed_steps, default=None)
        return f"stopped by {name} at step {step}, which did not commit; {resume_hint(latest)}"
