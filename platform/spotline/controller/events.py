"""The job's event log: what the controller says, once, for the user.

Every room says things through `Events.say`: the text is redacted (no secret from the
spec, the environment or a URI ever reaches a log or a status), logged, kept in order
for `status` (other threads read it under a lock), and, with `track`, sent to the
job's experiment trackers as an event of that kind.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from spotline.config.redact import redact

log = logging.getLogger("spotline.controller")


class Events:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[str] = []
        self.tracker: Callable[[str, str], None] | None = None
        """(kind, text) -> the trackers' event, set once they exist (telemetry)."""

    def say(self, text: str, level: int = logging.INFO, track: str | None = None) -> None:
        text = redact(text)
        log.log(level, text)
        with self._lock:
            self._events.append(text)
        if track is not None and self.tracker is not None:
            self.tracker(track, text)

    def since(self, first: int) -> tuple[list[str], int]:
        """The events from index `first` on, and the index of the next one."""
        with self._lock:
            return self._events[first:], len(self._events)
