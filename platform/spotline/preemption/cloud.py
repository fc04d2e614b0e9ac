"""Cloud metadata notice sources: AWS (IMDSv2 spot instance-action), GCP (the
`preempted` metadata key) and Azure (Scheduled Events), each one short HTTP request to
a link-local service, never through a proxy.

Like every source (`sources.py`), they never raise on a network error: an unreachable
metadata service is normal on the wrong cloud, and reads as "no notice".
"""

from __future__ import annotations

import email.utils
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from spotline.config.urls import check_http_url
from spotline.constants import SPOTLINE_AWS_IMDS_TOKEN_TTL_S, SPOTLINE_NOTICE_HTTP_TIMEOUT_S
from spotline.preemption.sources import (
    NETWORK_ERRORS,
    Notice,
    NoticeSource,
    logger,
    register,
)

if TYPE_CHECKING:
    from spotline.config.preemption import NoticeSourceSpec


# --- time parsing --------------------------------------------------------------------


def _parse_iso8601(text: str) -> float:
    """'2026-11-30T06:00:00Z' -> epoch seconds (naive times are UTC)."""
    dt = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def _parse_rfc1123(text: str) -> float:
    """'Mon, 19 Sep 2016 18:29:47 GMT' -> epoch seconds."""
    dt = email.utils.parsedate_to_datetime(text.strip())
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


# --- HTTP metadata sources -----------------------------------------------------------


@dataclass
class _Response:
    status: int
    headers: dict[str, str]  # lower-cased names
    body: str


class HttpNoticeSource(NoticeSource):
    """A source that asks a link-local metadata service over plain HTTP."""

    def __init__(self, spec: NoticeSourceSpec, node_id: str | None = None) -> None:
        super().__init__(spec, node_id)
        assert self.endpoint is not None
        self._base = self.endpoint.rstrip("/")
        # Metadata services are link-local: a proxy from the environment must never
        # carry these requests (the AWS SDKs bypass proxies for IMDS for the same reason).
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    @classmethod
    def check_endpoint(cls, endpoint: str) -> None:
        check_http_url(endpoint, f"endpoint of notice source {cls.name!r}", "http://127.0.0.1:8080")

    def _request(
        self, method: str, path: str, headers: dict[str, str], *, reason: str = "request"
    ) -> _Response | None:
        """One request; any HTTP status is a response, a network failure is None."""
        req = urllib.request.Request(
            self._base + path, method=method, headers=headers, data=b"" if method == "PUT" else None
        )
        try:
            with self._opener.open(req, timeout=SPOTLINE_NOTICE_HTTP_TIMEOUT_S) as resp:
                return _Response(
                    resp.status,
                    {k.lower(): v for k, v in resp.headers.items()},
                    resp.read().decode("utf-8", "replace"),
                )
        except urllib.error.HTTPError as e:
            try:
                body = e.read().decode("utf-8", "replace") if e.fp is not None else ""
            except NETWORK_ERRORS:
                body = ""
            finally:
                e.close()
            headers_in = {k.lower(): v for k, v in (e.headers or {}).items()}
            return _Response(e.code, headers_in, body)
        except NETWORK_ERRORS as e:
            logger.debug("%s: %s %s%s failed: %s", self.name, reason, self._base, path, e)
            return None


@register("aws")
class AwsSource(HttpNoticeSource):
    """AWS EC2 spot interruption notice through IMDSv2.

    PUT /latest/api/token gets a session token, reused until it nearly expires; then
    GET /latest/meta-data/spot/instance-action answers 404 until the interruption is
    scheduled, and then {"action": "terminate"|"stop"|"hibernate", "time": ISO-8601}
    about two minutes ahead. A 401 means the token expired or was revoked: get a new one
    and ask again.
    """

    default_endpoint = "http://169.254.169.254"
    default_deadline_s = 120.0
    TOKEN_PATH = "/latest/api/token"
    ACTION_PATH = "/latest/meta-data/spot/instance-action"
    TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
    TOKEN_HEADER = "X-aws-ec2-metadata-token"

    def __init__(
        self,
        spec: NoticeSourceSpec,
        node_id: str | None = None,
        *,
        token_ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(spec, node_id)
        ttl = SPOTLINE_AWS_IMDS_TOKEN_TTL_S if token_ttl_s is None else token_ttl_s
        self.token_ttl_s = int(min(max(ttl, 1), 21600))
        self._clock = clock  # for the token's lifetime
        self._token: str | None = None
        self._token_expires = 0.0  # on self._clock
        self._first_seen: float | None = None

    def _get_token(self, refresh: bool = False) -> str | None:
        # Renew a little before expiry so a GET never carries a token that dies in flight.
        margin = min(60.0, self.token_ttl_s * 0.1)
        if not refresh and self._token and self._clock() < self._token_expires - margin:
            return self._token
        self._token = None
        asked_at = self._clock()
        resp = self._request(
            "PUT", self.TOKEN_PATH, {self.TTL_HEADER: str(self.token_ttl_s)}, reason="token PUT"
        )
        if resp is None:
            return None
        if resp.status != 200 or not resp.body.strip():
            self._warn_once(f"token PUT {self.TOKEN_PATH} answered HTTP {resp.status}")
            return None
        self._token = resp.body.strip()
        self._token_expires = asked_at + self.token_ttl_s
        return self._token

    def _get_action(self, token: str) -> _Response | None:
        return self._request("GET", self.ACTION_PATH, {self.TOKEN_HEADER: token})

    def poll(self) -> Notice | None:
        token = self._get_token()
        if token is None:
            return None
        resp = self._get_action(token)
        if resp is not None and resp.status == 401:
            token = self._get_token(refresh=True)
            resp = None if token is None else self._get_action(token)
        if resp is None:
            return None
        if resp.status == 404:
            self._first_seen = None
            return None
        if resp.status != 200:
            self._warn_once(f"GET {self.ACTION_PATH} answered HTTP {resp.status}")
            return None
        try:
            doc = json.loads(resp.body)
            action = str(doc["action"])
        except (ValueError, KeyError, TypeError):
            self._warn_once(f"unreadable instance-action {resp.body[:200]!r}")
            return None
        if self._first_seen is None:
            self._first_seen = time.time()
        try:
            deadline = _parse_iso8601(str(doc["time"]))
        except (KeyError, ValueError):
            self._warn_once(f"instance-action without a readable time: {resp.body[:200]!r}")
            deadline = self._first_seen + self.deadline_s
        return self._notice(deadline, f"spot instance-action: {action}", doc)


@register("gcp")
class GcpSource(HttpNoticeSource):
    """GCP preemption (spot/preemptible VMs) through the metadata server.

    GET /computeMetadata/v1/instance/preempted with Metadata-Flavor: Google answers TRUE
    once the VM is being preempted, FALSE before. GCP gives 30 s and no deadline, so the
    deadline is the first TRUE + default_deadline_s. An answer without the
    Metadata-Flavor: Google header is not from the metadata server and is ignored.
    """

    default_endpoint = "http://metadata.google.internal"
    default_deadline_s = 30.0
    PATH = "/computeMetadata/v1/instance/preempted"

    def __init__(self, spec: NoticeSourceSpec, node_id: str | None = None) -> None:
        super().__init__(spec, node_id)
        self._first_seen: float | None = None

    def poll(self) -> Notice | None:
        resp = self._request("GET", self.PATH, {"Metadata-Flavor": "Google"})
        if resp is None:
            return None
        if resp.headers.get("metadata-flavor") != "Google":
            self._warn_once(
                f"ignoring an answer without 'Metadata-Flavor: Google' from {self._base} "
                "(not the GCP metadata server)"
            )
            return None
        if resp.status != 200:
            self._warn_once(f"GET {self.PATH} answered HTTP {resp.status}")
            return None
        value = resp.body.strip().upper()
        if value == "FALSE":
            self._first_seen = None
            return None
        if value != "TRUE":
            self._warn_once(f"unexpected instance/preempted value {resp.body[:100]!r}")
            return None
        if self._first_seen is None:
            self._first_seen = time.time()
        return self._notice(
            self._first_seen + self.deadline_s, "instance preempted", {"preempted": "TRUE"}
        )


@register("azure")
class AzureSource(HttpNoticeSource):
    """Azure spot eviction through Scheduled Events.

    GET /metadata/scheduledevents?api-version=2020-07-01 with Metadata: true answers
    {"DocumentIncarnation": n, "Events": [...]}; an event with EventType "Preempt" is an
    eviction, at NotBefore (RFC 1123; empty once the event has started). Other types
    (Freeze, Reboot, Redeploy, Terminate) are maintenance and are ignored. Events can name
    other VMs of the same availability set or scale set, so the source learns this VM's
    name once (instance/compute/name) and reports only events whose Resources include
    it. The source never acknowledges an event: that would start the eviction early.
    """

    default_endpoint = "http://169.254.169.254"
    default_deadline_s = 30.0
    EVENTS_PATH = "/metadata/scheduledevents?api-version=2020-07-01"
    NAME_PATH = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"

    def __init__(self, spec: NoticeSourceSpec, node_id: str | None = None) -> None:
        super().__init__(spec, node_id)
        self._vm_name: str | None = None
        self._name_known = False
        self._deadlines: dict[str, float] = {}  # EventId -> deadline, kept across polls

    def _resolve_vm_name(self) -> None:
        if self._name_known:
            return
        resp = self._request("GET", self.NAME_PATH, {"Metadata": "true"}, reason="VM name")
        if resp is None:
            return  # ask again next poll
        self._name_known = True
        if resp.status == 200 and resp.body.strip():
            self._vm_name = resp.body.strip()
        else:
            self._warn_once(
                f"VM name unknown (HTTP {resp.status}); reporting Preempt events for any VM"
            )

    def poll(self) -> Notice | None:
        self._resolve_vm_name()
        resp = self._request("GET", self.EVENTS_PATH, {"Metadata": "true"})
        if resp is None:
            return None
        if resp.status != 200:
            self._warn_once(f"GET {self.EVENTS_PATH} answered HTTP {resp.status}")
            return None
        try:
            doc = json.loads(resp.body)
            events = [e for e in doc.get("Events", []) if isinstance(e, dict)]
        except (ValueError, AttributeError):
            self._warn_once(f"unreadable scheduled events {resp.body[:200]!r}")
            return None
        notices = []
        live_ids = set()
        for event in events:
            if event.get("EventType") != "Preempt":
                continue
            resources = event.get("Resources") or []
            if self._vm_name is not None and resources and self._vm_name not in resources:
                continue
            event_id = str(event.get("EventId", ""))
            live_ids.add(event_id)
            deadline = self._deadlines.get(event_id)
            not_before = str(event.get("NotBefore") or "").strip()
            if not_before:
                try:
                    deadline = _parse_rfc1123(not_before)
                except (TypeError, ValueError):
                    self._warn_once(f"unreadable NotBefore {not_before!r}")
            if deadline is None:
                deadline = time.time() + self.deadline_s
            self._deadlines[event_id] = deadline
            detail = {"DocumentIncarnation": doc.get("DocumentIncarnation"), **event}
            notices.append(self._notice(deadline, "scheduled event Preempt", detail))
        self._deadlines = {k: v for k, v in self._deadlines.items() if k in live_ids}
        return min(notices, key=lambda n: n.deadline, default=None)
