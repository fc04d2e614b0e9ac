"""What other threads tell the controller: preemption notices, stop and re-partition
requests.

Node watchers and the SDK call in from other threads of the controller actor at any
moment; the state machine takes everything out at the start of each iteration, in
whatever state it is. A notice is accepted once (by source, node and deadline), and
`notify` returns True only when it was accepted or already known, so a watcher
re-sends until it is sure the controller has it. A notice that names its node dooms
that node until the controller learns it is gone (`forget`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Inbox:
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _seen: set[tuple] = field(default_factory=set)
    _notices: list[dict[str, Any]] = field(default_factory=list)
    _stop: str | None = None
    _repartition: list[int] | None = None
    _doomed: dict[str, float] = field(default_factory=dict)  # node id -> deadline

    def notify(self, notice: dict[str, Any], clock: float, wall: float) -> bool:
        """A notice received at `clock` (the controller's monotonic reading) and `wall`."""
        key = (notice["source"], notice.get("node_id"), notice["deadline"])
        with self._lock:
            if key not in self._seen:
                self._seen.add(key)
                self._notices.append(dict(notice, received_at=wall, received_clock=clock))
            node = notice.get("node_id")
            if node is not None:
                self._doomed[node] = notice["deadline"]
        return True

    def doomed(self) -> list[str]:
        """The nodes a notice named, sorted."""
        with self._lock:
            return sorted(self._doomed)

    def forget(self, nodes) -> None:
        """These nodes are gone: no longer doomed."""
        with self._lock:
            for node in nodes:
                self._doomed.pop(node, None)

    def stop(self, reason: str) -> None:
        with self._lock:
            self._stop = self._stop or reason

    def repartition(self, sizes: list[int]) -> None:
        with self._lock:
            self._repartition = sizes

    def take_repartition(self) -> list[int] | None:
        with self._lock:
            sizes, self._repartition = self._repartition, None
            return sizes

    def take(self) -> tuple[list[dict[str, Any]], str | None]:
        with self._lock:
            notices, self._notices = self._notices, []
            return notices, self._stop

    @property
    def stop_reason(self) -> str | None:
        with self._lock:
            return self._stop
