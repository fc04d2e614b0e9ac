"""The per-node notice watcher: polls every source on its own interval, in one daemon
thread, and delivers each distinct notice until it is acknowledged.

It must stay Ray-free (a Ray actor hosts it, the controller consumes its callbacks) and
must never die of a misbehaving source or callback: one error is logged, the next poll
goes ahead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from spotline.constants import SPOTLINE_NOTICE_WATCHER_STOP_TIMEOUT_S
from spotline.preemption.sources import Notice, NoticeSource
from spotline.registry import user_code_error

logger = logging.getLogger(__name__)


class NoticeWatcher:
    """Polls `sources` and calls `on_notice(notice)` for each distinct notice until it
    returns True (the receiver has it): a delivery that fails or is not acknowledged is
    tried again at every poll, whether or not the source still reports the notice.

    Notices are distinct by (source, node_id, deadline, reason): a source that keeps
    reporting the same notice is reported once, and a moved deadline is a new notice.
    `on_notice` runs on the watcher thread; it should hand the notice over and return.
    Start the watcher from the main thread when a sigterm source is among `sources`.
    """

    def __init__(
        self,
        sources: Sequence[NoticeSource],
        on_notice: Callable[[Notice], bool],
        *,
        name: str = "spotline-notice-watcher",
    ) -> None:
        self.sources = list(sources)
        self._on_notice = on_notice
        self._name = name
        self._seen: set[Notice] = set()
        self._delivered: list[Notice] = []
        self._unacked: list[Notice] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Open every source (e.g. install the SIGTERM handler) and start polling."""
        if self._thread is not None:
            raise RuntimeError("NoticeWatcher.start() called twice")
        opened: list[NoticeSource] = []
        try:
            for src in self.sources:
                src.open()
                opened.append(src)
        except BaseException:
            for src in reversed(opened):
                src.close()
            raise
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop polling and close every source (e.g. restore the SIGTERM handler)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(SPOTLINE_NOTICE_WATCHER_STOP_TIMEOUT_S if timeout is None else timeout)
            if thread.is_alive():
                logger.warning("notice watcher thread still polling after stop()")
            for src in reversed(self.sources):
                try:
                    src.close()
                except Exception:
                    logger.exception("closing notice source %r failed", src)

    def __enter__(self) -> NoticeWatcher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def notices(self) -> list[Notice]:
        """Every notice reported so far, in order."""
        with self._lock:
            return list(self._delivered)

    # --- polling ---------------------------------------------------------------------

    def poll_once(self) -> list[Notice]:
        """Poll every source now and report what is new; returns the new notices.

        The thread does the same per source on its schedule; tests and hosts that want no
        thread can call this directly.
        """
        new: list[Notice] = []
        for src in self.sources:
            new.extend(self._poll_source(src))
        self._redeliver()
        return new

    def _poll_source(self, src: NoticeSource) -> list[Notice]:
        try:
            found = src.poll_all()
        except Exception as e:
            theirs = user_code_error(e)
            if theirs is None:
                logger.exception("notice source %r failed; polling it again next interval", src)
            else:
                logger.error("notice source %r: %s; polling it again next interval", src, theirs)
            return []
        new = []
        for notice in found:
            with self._lock:
                if notice in self._seen:
                    continue
                self._seen.add(notice)
                self._delivered.append(notice)
            new.append(notice)
            logger.info(
                "preemption notice from %s: node %s, %s, %.1f s left",
                notice.source,
                notice.node_id,
                notice.reason,
                notice.remaining_s(),
            )
            self._deliver(notice)
        return new

    def _deliver(self, notice: Notice) -> None:
        try:
            acked = bool(self._on_notice(notice))
        except Exception:
            logger.exception("delivering %s failed; trying again at the next poll", notice)
            acked = False
        if not acked:
            with self._lock:
                if notice not in self._unacked:
                    self._unacked.append(notice)

    def _redeliver(self) -> None:
        with self._lock:
            todo, self._unacked = self._unacked, []
        for notice in todo:
            self._deliver(notice)

    def _run(self) -> None:
        due = [time.monotonic()] * len(self.sources)
        while not self._stop.is_set():
            now = time.monotonic()
            for i, src in enumerate(self.sources):
                if due[i] <= now and not self._stop.is_set():
                    self._poll_source(src)
                    due[i] = time.monotonic() + src.poll_interval_s
            self._redeliver()
            wait = min(due) - time.monotonic() if due else None
            self._stop.wait(None if wait is None else max(wait, 0.0))
