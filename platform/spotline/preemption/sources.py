"""Preemption notice sources: one class per protocol, registered by name.

A source answers one question, cheaply and often: "is this node about to go, and when?"
`poll()` makes at most one short request (AWS may add a token request), never blocks for
long, and never raises on a network error: an unreachable metadata service is normal on
the wrong cloud, or on a laptop, so it is logged at debug level and read as "no notice".
A source must make its deadline stable across polls (anchored at the first sighting when
the protocol gives none), because the watcher treats a changed deadline as a new notice.

Nothing here talks to the controller; `spotline.preemption.watcher` does the polling.
Ray is imported only by the ray-drain source, and only when it polls.
"""

from __future__ import annotations

import abc
import http.client
import logging
import signal
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from spotline.config.preemption import check_notice_endpoint
from spotline.constants import (
    SPOTLINE_NOTICE_HTTP_TIMEOUT_S,
    SPOTLINE_RAY_DRAIN_RPC_TIMEOUT_S,
)
from spotline.registry import NOTICE_SOURCES

if TYPE_CHECKING:
    from spotline.config.preemption import NoticeSourceSpec

logger = logging.getLogger(__name__)

# Errors that mean "the endpoint did not answer properly this time".
NETWORK_ERRORS = (urllib.error.URLError, http.client.HTTPException, OSError)


@dataclass(frozen=True)
class Notice:
    """A node will be taken away at `deadline`.

    Two notices are the same notice when source, node_id, deadline and reason match;
    `detail` (the raw protocol payload) is informational and takes no part in equality
    or hashing, so a watcher can dedupe notices in a set.
    """

    source: str
    """Registry name of the source that saw it ('aws', 'ray-drain', ...)."""
    node_id: str | None
    """Hex Ray node id of the doomed node; None when the watcher was not told its node."""
    deadline: float
    """Unix epoch seconds when the node is expected to be gone."""
    reason: str
    """Short human-readable cause, for logs and status."""
    detail: dict[str, Any] = field(default_factory=dict, compare=False)
    """Protocol payload (event JSON, drain deadline in ms, ...), for logs only."""

    def remaining_s(self, now: float | None = None) -> float:
        """Seconds left until the deadline (negative once it has passed)."""
        return self.deadline - (time.time() if now is None else now)


class NoticeSource(abc.ABC):
    """One protocol's view of "is this node being preempted?"."""

    name: ClassVar[str] = ""
    """Registry name; set by `register`."""
    default_endpoint: ClassVar[str | None] = None
    """Where the source asks when the spec gives no endpoint."""
    default_deadline_s: ClassVar[float] = 30.0
    """Seconds to the node's end assumed when the protocol gives no deadline."""

    def __init__(self, spec: NoticeSourceSpec, node_id: str | None = None) -> None:
        endpoint = spec.endpoint if spec.endpoint is not None else self.default_endpoint
        if spec.endpoint is not None:
            self.check_endpoint(spec.endpoint)
        self.endpoint = endpoint
        self.node_id = node_id
        self.poll_interval_s = spec.poll_interval_s
        self.deadline_s = (
            spec.default_deadline_s
            if spec.default_deadline_s is not None
            else type(self).default_deadline_s
        )
        self._warned: set[str] = set()

    @classmethod
    def check_endpoint(cls, endpoint: str) -> None:
        """Raise ValueError when `endpoint` cannot be an endpoint of this source."""
        raise ValueError(f"notice source {cls.name!r} takes no endpoint (got {endpoint!r})")

    @abc.abstractmethod
    def poll(self) -> Notice | None:
        """The current notice for the watched node, or None. Never raises on network errors."""

    def poll_all(self) -> list[Notice]:
        """Every current notice; more than one only for sources that watch several nodes."""
        notice = self.poll()
        return [] if notice is None else [notice]

    def open(self) -> None:  # noqa: B027 (a no-op hook, not abstract)
        """Called by the watcher before the first poll (from the thread that starts it)."""

    def close(self) -> None:  # noqa: B027
        """Called by the watcher after the last poll."""

    def _notice(self, deadline: float, reason: str, detail: dict[str, Any]) -> Notice:
        return Notice(self.name, self.node_id, deadline, reason, detail)

    def _warn_once(self, message: str) -> None:
        """A protocol anomaly repeats on every poll: warn once, then log at debug."""
        if message in self._warned:
            logger.debug("%s: %s", self.name, message)
        else:
            self._warned.add(message)
            logger.warning("%s notice source: %s", self.name, message)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(endpoint={self.endpoint!r}, node_id={self.node_id!r})"


# --- registry ------------------------------------------------------------------------

_S = TypeVar("_S", bound=type[NoticeSource])


def register(name: str) -> Callable[[_S], _S]:
    """Class decorator: make a NoticeSource available under `name` in specs."""

    def deco(cls: _S) -> _S:
        cls.name = name
        return NOTICE_SOURCES.register(name, cls)

    return deco


def source_names() -> list[str]:
    """Registered source names, sorted."""
    return NOTICE_SOURCES.names()


def source_class(name: str) -> type[NoticeSource]:
    """The class registered as `name` (or a `module:attr`); ValueError naming the valid
    kinds when there is none."""
    cls = NOTICE_SOURCES.load(name, "preemption.sources[].kind")
    if not (isinstance(cls, type) and issubclass(cls, NoticeSource)):
        raise ValueError(
            f"preemption.sources[].kind: {name!r} is {cls!r}, not a NoticeSource subclass"
        )
    if not cls.name:
        cls.name = name
    return cls


def make_source(spec: NoticeSourceSpec, *, node_id: str | None = None) -> NoticeSource:
    """Build the source a spec names. `node_id` is the hex Ray node id of the node the
    watcher runs on: it labels cloud and SIGTERM notices, and restricts ray-drain to
    that node (None: ray-drain reports every draining node)."""
    return source_class(spec.kind)(spec, node_id=node_id)


# --- SIGTERM -------------------------------------------------------------------------


@register("sigterm")
class SigtermSource(NoticeSource):
    """SIGTERM to this process, as Kubernetes sends before it kills a pod.

    `install()` replaces the SIGTERM handler with one that only records the time. It
    deliberately does NOT chain to the previous handler: the default action (and Ray's
    own worker handler) ends the process, and the point is to stay alive until the
    just-in-time checkpoint commits. The sender enforces the end anyway (Kubernetes sends
    SIGKILL after terminationGracePeriodSeconds, 30 s by default, the default deadline).

    Python runs signal handlers only in the main thread, so `install()` must be called
    there, and the handler runs when that thread next executes Python code (a main thread
    parked inside a C call, as in a Ray worker's task loop, delays it).
    """

    default_deadline_s = 30.0

    def __init__(self, spec: NoticeSourceSpec, node_id: str | None = None) -> None:
        super().__init__(spec, node_id)
        self._signalled_at: float | None = None
        self._previous: Any = None
        self._installed = False

    def install(self) -> None:
        """Take over SIGTERM. Idempotent; main thread only."""
        if self._installed:
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "the sigterm notice source must be installed from the main thread (Python "
                "delivers signals only there): start the NoticeWatcher from the main thread"
            )
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True

    def uninstall(self) -> None:
        """Put back the handler that was there before `install()`."""
        if not self._installed:
            return
        previous = self._previous if self._previous is not None else signal.SIG_DFL
        signal.signal(signal.SIGTERM, previous)
        self._installed = False

    @property
    def installed(self) -> bool:
        return self._installed

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # Keep the first one: a repeated SIGTERM does not move the deadline.
        if self._signalled_at is None:
            self._signalled_at = time.time()

    def open(self) -> None:
        self.install()

    def close(self) -> None:
        self.uninstall()

    def poll(self) -> Notice | None:
        at = self._signalled_at
        if at is None:
            return None
        return self._notice(at + self.deadline_s, "SIGTERM", {"signal": "SIGTERM", "at": at})


# --- Ray node drain ------------------------------------------------------------------


@register("ray-drain")
class RayDrainSource(NoticeSource):
    """Ray's own node drain: nodes the GCS marks as draining, with their deadline.

    The autoscaler (v2), KubeRay, `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION
    --deadline-remaining-seconds N` and `ray start --block` on SIGTERM all call the GCS
    DrainNode RPC with a deadline in ms. One GetDrainingNodes RPC
    (`GcsClient.get_draining_nodes()`, {node_id_hex: deadline_ms}, 0 for no deadline)
    answers in about a millisecond, so polling every second is cheap. A drain without a
    deadline gets first sighting + default_deadline_s.

    The GCS is the spec's endpoint (host:port) if given, else the cluster this process
    is connected to (ray.init), else RAY_ADDRESS or the latest local cluster.
    """

    default_deadline_s = 30.0

    def __init__(self, spec: NoticeSourceSpec, node_id: str | None = None) -> None:
        super().__init__(spec, node_id)
        self._client: Any = None
        self._first_seen: dict[str, float] = {}

    @classmethod
    def check_endpoint(cls, endpoint: str) -> None:
        check_notice_endpoint("ray-drain", endpoint)

    def _gcs_client(self) -> Any:
        if self._client is not None:
            return self._client
        import ray

        from spotline.compat import ray as ray_internals

        address = self.endpoint
        if address is None and ray.is_initialized():
            self._client = ray_internals.gcs_client()
            return self._client
        if address is None:
            try:
                address = ray_internals.bootstrap_address()
            except Exception as e:  # a malformed RAY_ADDRESS, a stale cluster file
                self._warn_once(f"no Ray cluster address found: {e}")
                return None
            if address is None:
                logger.debug("ray-drain: no Ray cluster to watch yet")
                return None
        # GcsClient() blocks for tens of seconds on an address nobody listens on; a TCP
        # probe first keeps a poll short when the GCS is not up (yet).
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), SPOTLINE_NOTICE_HTTP_TIMEOUT_S).close()
        except OSError as e:
            logger.debug("ray-drain: GCS %s unreachable: %s", address, e)
            return None
        self._client = ray_internals.gcs_client(address)
        return self._client

    def poll_all(self) -> list[Notice]:
        client = self._gcs_client()
        if client is None:
            return []
        from ray.exceptions import RpcError

        from spotline.compat.ray import draining_nodes

        try:
            draining = draining_nodes(SPOTLINE_RAY_DRAIN_RPC_TIMEOUT_S, client)
        except (RpcError, TimeoutError, OSError) as e:
            logger.debug("ray-drain: GetDrainingNodes failed: %s", e)
            return []
        now = time.time()
        self._first_seen = {k: v for k, v in self._first_seen.items() if k in draining}
        notices = []
        for node_hex, deadline_ms in draining.items():
            if self.node_id is not None and node_hex != self.node_id:
                continue
            if deadline_ms > 0:
                deadline = deadline_ms / 1000.0
            else:
                deadline = self._first_seen.setdefault(node_hex, now) + self.deadline_s
            notices.append(
                Notice(
                    self.name,
                    node_hex,
                    deadline,
                    "node draining",
                    {"deadline_timestamp_ms": deadline_ms},
                )
            )
        return sorted(notices, key=lambda n: n.deadline)

    def poll(self) -> Notice | None:
        notices = self.poll_all()
        return notices[0] if notices else None
