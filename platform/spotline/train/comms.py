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
- NCCL has its own abort (`ncclCommAbort` of every communicator, grouped, through
  torch's `_abort_process_group`). It needs nothing agreed. torch's `shrink_group` is
  not used: it is a collective of the survivors, who must already know which ranks
  went, while a rank here aborts on its own, at once. torch's own watchdog is told to
  leave the communicators to this abort (`settle_nccl_error_handling`).

Every backend's abort runs once per group, on a thread of its own (never the thread
that asked: the training thread, or the one the controller's calls run on), under a
watchdog (SPOTLINE_COMM_ABORT_TIMEOUT_S). An abort that has not returned by then is
reported, not waited on (`Cut.hung`, a `CommsHung`): that process holds a thread stuck
in the backend, so it is never kept, its replica is ended, and the controller cordons
its node. `abort` never raises: it runs in failure paths, where an error of its own
would replace the error that ended the step (and change how the failure is classified).

How long a restart waits for a surviving rank to be free follows its backend
(`reform_grace_s`).

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
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

from spotline import constants
from spotline.train.watch import CommsHung, Watch

log = logging.getLogger("spotline.comms")

_KEY = "spotline/gloo-listeners/{rank}"


class Comms(Protocol):
    """This rank's communicators, as far as cutting them goes. One per group joined."""

    def begin(self) -> None:
        """Before the rank joins its process group."""

    def agree(self, store: Any, world_size: int, timeout_s: float) -> None:
        """Once every group of the rank's engine exists: swap with every other rank, in
        the rendezvous `store`, what the cut needs to know (collective: every rank)."""

    def abort(self) -> Cut:
        """Cut them now, so that every peer waiting on this rank fails at once: the
        first call cuts, every later one waits for that same cut and returns what it
        did. Never raises; safe from any thread."""


@dataclass(frozen=True)
class Cut:
    """What a rank's abort did: `n` communicators or links cut (0: none, or it failed,
    said in the log); `hung`: it had not returned within its watchdog."""

    n: int = 0
    hung: CommsHung | None = None


def comms_for(backend: str, rank: int, node: str = "") -> Comms:
    """The implementation for the process group `backend` this rank (on `node`, for
    what it says) initialises."""
    if backend == "nccl":
        return NcclAbort(rank, node)
    return GlooLinks(rank, node=node)


class _Watched:
    """The abort every backend shares: `_cut` once, under a watchdog (see the module).
    `timeout_s`: None reads SPOTLINE_COMM_ABORT_TIMEOUT_S at the abort."""

    what = "cutting its communicators"

    def __init__(self, rank: int, node: str = "", timeout_s: float | None = None) -> None:
        self.rank = rank
        self.node = node
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._watch: Watch | None = None
        self._said = False  # a failed abort's warning
        self.hung: CommsHung | None = None
        """Set once the abort outran its watchdog: the process is not to be kept."""

    def _cut(self) -> int:
        raise NotImplementedError

    def abort(self) -> Cut:
        with self._lock:
            if self._watch is None:
                limit = self._timeout_s
                if limit is None:
                    limit = constants.SPOTLINE_COMM_ABORT_TIMEOUT_S
                self._watch = Watch(self._cut, limit, f"spotline-abort-{self.rank}")
            w = self._watch
        if not w.wait():
            return Cut(0, self._hang(w.timeout_s))
        if w.error is not None:
            self._failed(w.error)
            return Cut()
        return Cut(int(w.value or 0))

    def _hang(self, timeout_s: float) -> CommsHung:
        with self._lock:
            if self.hung is None:  # said once, by the first caller to see it
                self.hung = CommsHung(
                    self.rank, self.node, self.what, timeout_s, "SPOTLINE_COMM_ABORT_TIMEOUT_S"
                )
                log.critical("%s", self.hung)
                with contextlib.suppress(Exception):
                    for h in logging.getLogger().handlers + log.handlers:
                        h.flush()
            return self.hung

    def _failed(self, e: BaseException) -> None:
        with self._lock:  # said once, by the first caller to see it
            said, self._said = self._said, True
        if said:
            return
        log.warning(
            "rank %d: %s failed (%s: %s); peers waiting on it fail at failure.collective_timeout_s",
            self.rank,
            self.what,
            type(e).__name__,
            e,
        )


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


class GlooLinks(_Watched):
    """This rank's gloo links (see the module)."""

    what = "cutting its gloo links"

    def __init__(
        self,
        rank: int,
        connections: Callable[[], list[Any]] = _tcp,
        node: str = "",
        timeout_s: float | None = None,
    ) -> None:
        super().__init__(rank, node, timeout_s)
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

    def _cut(self) -> int:
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


class NcclAbort(_Watched):
    """This rank's NCCL communicators, aborted under a watchdog (see the module)."""

    what = "aborting its NCCL communicators"

    def __init__(
        self,
        rank: int,
        node: str = "",
        abort_groups: Callable[[], Any] = _abort_nccl,
        timeout_s: float | None = None,
    ) -> None:
        super().__init__(rank, node, timeout_s)
        self._abort_groups = abort_groups
        """Aborts every process group of this process; falsy when there was none."""

    def begin(self) -> None:
        """Nothing: NCCL's abort needs nothing known beforehand."""

    def agree(self, store: Any, world_size: int, timeout_s: float) -> None:
        """Nothing to agree: each rank aborts its own communicators."""

    def _cut(self) -> int:
        aborted = bool(self._abort_groups())
        if aborted:
            log.warning("rank %d: its group is over; aborted its NCCL communicators", self.rank)
        return int(aborted)


# How torch's NCCL watchdog handles a failed or timed-out collective, by its own names
# (the first one set wins, as torch reads them).
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")


def settle_nccl_error_handling(env: MutableMapping[str, str]) -> str | None:
    """Leave a failed NCCL communicator to this rank's abort: set torch's error handling
    to 0 in `env` unless the user set a mode; returns what to warn about a mode that
    works against in-place recovery (None: nothing to say).

    Decided against torch 2.13 (ProcessGroupNCCL.hpp, `_abort_process_group` in
    distributed_c10d.py). The modes: 0 handles nothing; 1 (torch's old default) aborts
    the communicators and ends the process; 2 aborts them on torch's watchdog thread and
    lets the error reach the step; 3 ends the process without aborting. In-place
    recovery needs the process to live, which rules out 1 and 3. Under 2 torch's
    watchdog and this rank's `NcclAbort` (from the failing step, or from the restart)
    can abort the same communicators at the same moment from two threads, torch's
    outside the NCCL group that `_abort_process_group` opens so that one abort cannot
    wait on another; torch documents `_abort_process_group` for mode 0 for that reason.
    So 0: one owner of the abort. What it costs: torch no longer breaks a collective
    that never completes (its timeout is logged, and dumped where the flight recorder
    is on); a rank blocked in one is woken by the restart's abort, or, in a hang, by the
    controller's hang watch, which ends the group. Both are Spotline's own paths."""
    name, raw = next(((n, env[n]) for n in NCCL_ERROR_HANDLING if env.get(n)), ("", ""))
    if not name:
        env[NCCL_ERROR_HANDLING[0]] = "0"
        return None
    mode = raw.strip()
    unset = "unset it and Spotline sets 0 (one owner of the abort)"
    if mode == "0":
        return None
    if mode == "2":
        return (
            f"{name}=2 is set: torch's NCCL watchdog then aborts a failed communicator on "
            "its own thread while the rank's own abort may abort the same one at the same "
            f"moment (torch documents its abort for mode 0); {unset}"
        )
    if mode in ("1", "3"):
        return (
            f"{name}={mode} is set: torch ends a rank's process at an NCCL error or "
            "timeout, so recovery.in_place keeps no NCCL rank (each starts again in a new "
            f"process); {unset}"
        )
    return f"{name}={raw!r} is not one of torch's modes (0, 1, 2, 3); {unset}"


def reform_grace_s(backend: str, configured: float | None = None) -> float:
    """How long a restart waits for a surviving rank's training to end before it ends
    the rank's replica too: recovery.reform_grace_s when set (`configured`), else the
    backend's, SPOTLINE_REFORM_GRACE_NCCL_S or SPOTLINE_REFORM_GRACE_GLOO_S."""
    if configured is not None:
        return configured
    if backend == "nccl":
        return constants.SPOTLINE_REFORM_GRACE_NCCL_S
    return constants.SPOTLINE_REFORM_GRACE_GLOO_S
