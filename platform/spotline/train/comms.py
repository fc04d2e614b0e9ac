"""Cutting a rank's communicators when its group is over: one interface, for gloo and NCCL.

When a rank goes, a collective fails at once only on the ranks that wait on it. A rank
that waits on another survivor (alive, its own collective already failed) stays
blocked until the collective timeout. So a rank whose step failed, and every rank of a
group that ended, aborts its communicators (`Comms.abort`): every peer still waiting
on it fails within moments, and its process stays good to re-form in
(recovery.in_place). Which implementation a rank uses follows the backend it
initialised (`comms_for`):

- gloo offers no abort that wakes a blocked wait, from any thread; a peer whose
  connection closes does wake it, as a dead process's does. `GlooLinks` shuts the
  rank's gloo connections. Which connections are gloo's is known exactly, never
  guessed: while a rank joins (`begin` before its process group, `agree` once its
  engine built every group), the sockets it started to listen on are its gloo
  listeners; the ranks swap them through the rendezvous store. A link is a connection
  to or from one of them, and each descriptor is checked to still be that connection
  before it is shut: nothing else the process holds (Ray's own connections, storage
  clients, a socket that reused a closed descriptor's number) is touched.
- NCCL has its own abort (`ncclCommAbort`, through torch). `NcclAbort` runs it under a
  watchdog: an abort that has not returned within SPOTLINE_COMM_ABORT_TIMEOUT_S ends
  the process (a GPU whose abort hangs cannot be trusted to train again), rather than
  leaving the rank, its peers and the next group waiting. It needs nothing agreed.
  torch's `shrink_group` is not used: it is a collective of the survivors, who must
  already know which ranks went, while a rank here aborts on its own, at once.

`abort` never raises: it runs in failure paths, where an error of its own would
replace the error that ended the step (and change how the failure is classified).
Never here: Ray, the training loop, a decision about which ranks are kept.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any, Protocol

from spotline import constants

log = logging.getLogger("spotline.comms")

_KEY = "spotline/gloo-listeners/{rank}"


class Comms(Protocol):
    """This rank's communicators, as far as cutting them goes. One per group joined."""

    def begin(self) -> None:
        """Before the rank joins its process group."""

    def agree(self, store: Any, world_size: int, timeout_s: float) -> None:
        """Once every group of the rank's engine exists: swap with every other rank, in
        the rendezvous `store`, what the cut needs to know (collective: every rank)."""

    def abort(self) -> int:
        """Cut them now, so that every peer waiting on this rank fails at once. Returns
        how many were cut (0: none, or it failed, said in the log). Never raises; safe
        to call more than once and from any thread."""


def comms_for(backend: str, rank: int) -> Comms:
    """The implementation for the process group `backend` this rank initialises."""
    if backend == "nccl":
        return NcclAbort(rank)
    return GlooLinks(rank)


# --- gloo -----------------------------------------------------------------------------


def _tcp() -> list[Any]:
    import psutil

    return psutil.Process().net_connections(kind="tcp")


def _ip(text: str) -> Any:
    """An address as one value however it is written (an IPv4-mapped IPv6 one as IPv4)."""
    ip = ipaddress.ip_address(text.split("%")[0])
    return getattr(ip, "ipv4_mapped", None) or ip


def _same_end(sock_addr: Any, listed: Any) -> bool:
    """Whether a socket's own address (getsockname/getpeername) is the (ip, port) psutil
    listed."""
    if not isinstance(sock_addr, tuple) or len(sock_addr) < 2 or not listed:
        return False
    try:
        return _ip(str(sock_addr[0])) == _ip(listed.ip) and sock_addr[1] == listed.port
    except ValueError:
        return False


class GlooLinks:
    """This rank's gloo links (see the module)."""

    def __init__(self, rank: int, connections: Callable[[], list[Any]] = _tcp) -> None:
        self.rank = rank
        self._connections = connections
        """This process's TCP connections, as psutil lists them (tests pass their own)."""
        self._before: set[tuple[str, int]] | None = None
        self.listeners: set[tuple[str, int]] = set()
        """Every rank's gloo listening (ip, port) of the group, this rank's included."""

    def _listening(self) -> set[tuple[str, int]]:
        import psutil

        listed = self._connections()
        return {(c.laddr.ip, c.laddr.port) for c in listed if c.status == psutil.CONN_LISTEN}

    def begin(self) -> None:
        try:
            self._before = self._listening()
        except Exception as e:  # noqa: BLE001 - the cut is lost, not the group
            self._before = None
            self._unknown(e)

    def agree(self, store: Any, world_size: int, timeout_s: float) -> None:
        from datetime import timedelta

        own: list[tuple[str, int]] = []
        if self._before is not None:
            try:
                own = sorted(self._listening() - self._before)
            except Exception as e:  # noqa: BLE001 - every rank still publishes its key
                self._unknown(e)
        store.set(_KEY.format(rank=self.rank), json.dumps(own))
        keys = [_KEY.format(rank=r) for r in range(world_size)]
        store.wait(keys, timedelta(seconds=timeout_s))
        # One request for every rank's listeners, not one per rank: at thousands of
        # ranks, each asking the one rendezvous store for every key in turn would cost
        # the store a quadratic number of round trips.
        got = store.multi_get(keys)
        self.listeners = {(ip, int(port)) for raw in got for ip, port in json.loads(raw)}

    def _unknown(self, e: BaseException) -> None:
        log.warning(
            "rank %d: cannot list its connections (%s: %s), so its gloo listeners are "
            "unknown: if its step fails, peers waiting on it fail only at "
            "failure.collective_timeout_s",
            self.rank,
            type(e).__name__,
            e,
        )

    def _is_link(self, c: Any, ports: dict[int, set[str]]) -> bool:
        """A connection to or from one of the listeners (`ports`: their ips by port)."""
        if not c.raddr:
            return False
        for end in (c.laddr, c.raddr):
            ips = ports.get(end.port, ())
            if end.ip in ips or "0.0.0.0" in ips or "::" in ips:
                return True
        return False

    def abort(self) -> int:
        """Shut every gloo connection of this rank, both ways."""
        n = 0
        try:
            import psutil

            ports: dict[int, set[str]] = {}
            for ip, port in self.listeners:
                ports.setdefault(port, set()).add(ip)
            for c in self._connections():
                if c.status == psutil.CONN_ESTABLISHED and c.fd >= 0 and self._is_link(c, ports):
                    n += _shut(c)
        except Exception as e:  # noqa: BLE001 - never replaces the error being handled
            log.warning(
                "rank %d: could not cut its gloo links (%s: %s); %d were cut, and peers "
                "waiting on the rest fail at failure.collective_timeout_s",
                self.rank,
                type(e).__name__,
                e,
                n,
            )
        if n:
            log.warning("rank %d: its group is over; cut its %d gloo link(s)", self.rank, n)
        return n


def _shut(c: Any) -> int:
    """Shut the connection psutil listed as `c` (1), or nothing when descriptor `c.fd`
    no longer is that connection (0): gloo may have closed it since, and the kernel gives
    a closed number to the next descriptor any thread opens. The check is made on a
    duplicate, which stays that same socket whatever happens to the number; shutdown acts
    on the connection, and closing the duplicate leaves gloo's descriptor to gloo."""
    try:
        fd = os.dup(c.fd)
    except OSError:  # closed since it was listed
        return 0
    try:
        s = socket.socket(fileno=fd)
    except OSError:  # the number now holds something that is not a socket
        os.close(fd)
        return 0
    with s:
        try:
            if not (_same_end(s.getsockname(), c.laddr) and _same_end(s.getpeername(), c.raddr)):
                return 0
            s.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected any more: closed by gloo or the peer
            return 0
    return 1


# --- NCCL -----------------------------------------------------------------------------


def _abort_nccl() -> bool:
    from spotline.compat.torch import abort_process_groups

    return abort_process_groups()


class NcclAbort:
    """This rank's NCCL communicators, aborted under a watchdog (see the module)."""

    def __init__(
        self,
        rank: int,
        abort_groups: Callable[[], Any] = _abort_nccl,
        exit_process: Callable[[int], Any] = os._exit,
        timeout_s: float | None = None,
    ) -> None:
        self.rank = rank
        self._abort_groups = abort_groups
        """Aborts every process group of this process; falsy when there was none."""
        self._exit = exit_process
        self._timeout_s = (
            constants.SPOTLINE_COMM_ABORT_TIMEOUT_S if timeout_s is None else timeout_s
        )
        self._lock = threading.Lock()
        self._started = False

    def begin(self) -> None:
        """Nothing: NCCL's abort needs nothing known beforehand."""

    def agree(self, store: Any, world_size: int, timeout_s: float) -> None:
        """Nothing to agree: each rank aborts its own communicators."""

    def abort(self) -> int:
        with self._lock:
            if self._started:  # the first call aborts (or ends the process)
                return 0
            self._started = True
        try:
            return self._abort_watched()
        except Exception as e:  # noqa: BLE001 - never replaces the error being handled
            log.warning("rank %d: could not abort its NCCL communicators: %s", self.rank, e)
            return 0

    def _abort_watched(self) -> int:
        outcome: list[Any] = []
        done = threading.Event()

        def run() -> None:
            try:
                outcome.append(bool(self._abort_groups()))
            except Exception as e:  # noqa: BLE001 - reported by the waiting thread
                outcome.append(e)
            finally:
                done.set()

        threading.Thread(target=run, name=f"spotline-nccl-abort-{self.rank}", daemon=True).start()
        if not done.wait(self._timeout_s):
            log.critical(
                "rank %d: aborting its NCCL communicators did not return within %.0fs "
                "(SPOTLINE_COMM_ABORT_TIMEOUT_S); ending its process rather than hanging: "
                "the rank starts in a new process, and a GPU that hangs again here should "
                "be drained",
                self.rank,
                self._timeout_s,
            )
            with contextlib.suppress(Exception):
                for h in logging.getLogger().handlers + log.handlers:
                    h.flush()
            self._exit(1)
            return 0
        result = outcome[0]
        if isinstance(result, Exception):
            log.warning(
                "rank %d: aborting its NCCL communicators failed (%s: %s); peers waiting "
                "on it fail at failure.collective_timeout_s",
                self.rank,
                type(result).__name__,
                result,
            )
            return 0
        if result:
            log.warning("rank %d: its group is over; aborted its NCCL communicators", self.rank)
        return int(result)
