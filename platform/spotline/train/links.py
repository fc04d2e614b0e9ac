"""A rank's gloo links to its peers, and cutting them when its step failed.

When a rank goes, gloo fails at once only the ranks that wait on it. A rank that waits
on another survivor (alive, its own collective already failed) stays blocked until the
collective timeout: gloo offers no abort that wakes a blocked wait, from any thread.
A peer whose connection closes does wake it, as a dead process's does. So a rank
whose step failed shuts its gloo connections (`cut`): every peer still waiting on it
fails within milliseconds, and its process stays good to re-form in (recovery.in_place).

Which connections are gloo's is known exactly, never guessed: while a rank joins
(`Links.begin` before its process group, `Links.agree` once its engine built every
group), the sockets it started to listen on are its gloo listeners; the ranks swap
them through the rendezvous store. A link is a connection to or from one of them.
Nothing else the process holds (Ray's own connections, storage clients) is touched.
NCCL has its own abort (`ncclCommAbort`); this is for gloo only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from typing import Any

log = logging.getLogger("spotline.links")

_KEY = "spotline/gloo-listeners/{rank}"


def _tcp() -> list[Any]:
    import psutil

    return psutil.Process().net_connections(kind="tcp")


def _listening() -> set[tuple[str, int]]:
    import psutil

    return {(c.laddr.ip, c.laddr.port) for c in _tcp() if c.status == psutil.CONN_LISTEN}


class Links:
    """This rank's gloo links (see the module). One per process group joined."""

    def __init__(self) -> None:
        self._before: set[tuple[str, int]] | None = None
        self.listeners: set[tuple[str, int]] = set()
        """Every rank's gloo listening (ip, port) of the group, this rank's included."""

    def begin(self) -> None:
        """Before the rank joins its process group."""
        self._before = _listening()

    def agree(self, store: Any, rank: int, world_size: int, timeout_s: float) -> None:
        """Once every group of the rank's engine exists: publish this rank's new
        listeners in the rendezvous `store` and read every other rank's."""
        from datetime import timedelta

        assert self._before is not None, "begin() first"
        own = sorted(_listening() - self._before)
        store.set(_KEY.format(rank=rank), json.dumps(own))
        keys = [_KEY.format(rank=r) for r in range(world_size)]
        store.wait(keys, timedelta(seconds=timeout_s))
        self.listeners = {
            (ip, int(port)) for k in keys for ip, port in json.loads(store.get(k).decode())
        }

    def _is_link(self, c: Any) -> bool:
        if not c.raddr:
            return False
        for ip, port in self.listeners:
            for end in (c.laddr, c.raddr):
                if end.port == port and ip in (end.ip, "0.0.0.0", "::"):
                    return True
        return False

    def cut(self) -> int:
        """Shut every gloo connection of this rank (both ways): the peers waiting on it
        fail at once. Returns how many were shut. Safe to call more than once."""
        import psutil

        n = 0
        for c in _tcp():
            if c.status != psutil.CONN_ESTABLISHED or c.fd < 0 or not self._is_link(c):
                continue
            with contextlib.suppress(OSError):  # already closed by gloo or the peer
                # A duplicate of gloo's descriptor: shutdown acts on the connection,
                # and closing the duplicate leaves gloo's own descriptor to gloo.
                s = socket.socket(fileno=os.dup(c.fd))
                try:
                    s.shutdown(socket.SHUT_RDWR)
                    n += 1
                finally:
                    s.close()
        return n
