"""Preemption notice sources and the watcher.

Every HTTP source is tested against a loopback server that speaks its real protocol
(IMDSv2 tokens, GCP's Metadata-Flavor, Azure's Metadata header and Scheduled Events).
The ray-drain test drains a node of a real multi-node `Cluster` through the GCS, exactly
as `ray drain-node` does; it runs in a subprocess (this file run as a script) so it never
touches the session's own `ray.init`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from pydantic import ValidationError

from spotline.config import NoticeSourceSpec, PreemptionSpec
from spotline.preemption import (
    Notice,
    NoticeSource,
    NoticeWatcher,
    make_source,
    source_names,
)
from spotline.preemption.cloud import AwsSource
from spotline.preemption.sources import SigtermSource

NODE = "ab" * 28  # a hex Ray node id

# --- loopback metadata servers -----------------------------------------------------------


@dataclass
class Reply:
    status: int
    body: str = ""
    headers: dict[str, str] = field(default_factory=dict)


class MetadataApp:
    """One cloud's metadata protocol; records every request it sees."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.statuses: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, method: str, path: str, headers: dict[str, str]) -> Reply:
        with self.lock:
            self.requests.append((method, path, headers))
            reply = self.handle(method, path, headers)
            self.statuses.append(reply.status)
            return reply

    def handle(self, method: str, path: str, headers: dict[str, str]) -> Reply:
        raise NotImplementedError

    def count(self, method: str, path_prefix: str = "") -> int:
        with self.lock:
            return sum(1 for m, p, _ in self.requests if m == method and p.startswith(path_prefix))


class ImdsV2(MetadataApp):
    """EC2 IMDSv2: PUT a token, then GET with it; spot/instance-action 404s until set."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.clock = clock
        self.tokens: dict[str, float] = {}  # token -> expiry, on `clock`
        self.action: dict[str, str] | None = None

    def revoke_tokens(self) -> None:
        with self.lock:
            self.tokens.clear()

    def handle(self, method: str, path: str, headers: dict[str, str]) -> Reply:
        if method == "PUT" and path == AwsSource.TOKEN_PATH:
            ttl = headers.get("x-aws-ec2-metadata-token-ttl-seconds", "")
            if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return Reply(400)
            token = uuid.uuid4().hex
            self.tokens[token] = self.clock() + int(ttl)
            return Reply(200, token, {"X-aws-ec2-metadata-token-ttl-seconds": ttl})
        if method != "GET":
            return Reply(405)
        token = headers.get("x-aws-ec2-metadata-token")
        if token is None or self.tokens.get(token, 0.0) < self.clock():
            return Reply(401)
        if path == AwsSource.ACTION_PATH:
            if self.action is None:
                return Reply(404, "Not Found")
            return Reply(200, json.dumps(self.action), {"Content-Type": "text/plain"})
        return Reply(404)


class GcpMetadata(MetadataApp):
    """GCP metadata server; `genuine=False` plays an impostor that omits Metadata-Flavor."""

    PATH = "/computeMetadata/v1/instance/preempted"

    def __init__(self, genuine: bool = True) -> None:
        super().__init__()
        self.preempted = False
        self.genuine = genuine

    def handle(self, method: str, path: str, headers: dict[str, str]) -> Reply:
        flavor = {"Metadata-Flavor": "Google"} if self.genuine else {}
        if headers.get("metadata-flavor") != "Google":
            return Reply(403, "Missing Metadata-Flavor:Google header.", flavor)
        if method != "GET" or path != self.PATH:
            return Reply(404, "", flavor)
        return Reply(200, "TRUE" if self.preempted else "FALSE", flavor)


class AzureImds(MetadataApp):
    """Azure IMDS: Scheduled Events plus the VM's own name."""

    def __init__(self, vm_name: str = "spot-vm-1") -> None:
        super().__init__()
        self.vm_name = vm_name
        self.events: list[dict[str, Any]] = []
        self.incarnation = 1

    def add_event(self, event_type: str, resources: list[str], not_before: float | str) -> None:
        if isinstance(not_before, float):
            not_before = format_datetime(
                datetime.fromtimestamp(not_before, timezone.utc), usegmt=True
            )
        with self.lock:
            self.incarnation += 1
            self.events.append(
                {
                    "EventId": str(uuid.uuid4()).upper(),
                    "EventType": event_type,
                    "ResourceType": "VirtualMachine",
                    "Resources": resources,
                    "EventStatus": "Scheduled",
                    "NotBefore": not_before,
                    "Description": "",
                    "EventSource": "Platform",
                    "DurationInSeconds": -1,
                }
            )

    def handle(self, method: str, path: str, headers: dict[str, str]) -> Reply:
        if headers.get("metadata") != "true":
            return Reply(400, '{"error": "Bad request. Required metadata header not specified"}')
        if path == "/metadata/scheduledevents?api-version=2020-07-01":
            doc = {"DocumentIncarnation": self.incarnation, "Events": self.events}
            return Reply(200, json.dumps(doc), {"Content-Type": "application/json"})
        if path.startswith("/metadata/instance/compute/name?"):
            return Reply(200, self.vm_name, {"Content-Type": "text/plain"})
        return Reply(404)


class _Handler(BaseHTTPRequestHandler):
    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        headers = {k.lower(): v for k, v in self.headers.items()}
        reply = self.server.app(self.command, self.path, headers)  # type: ignore[attr-defined]
        body = reply.body.encode()
        self.send_response(reply.status)
        for k, v in reply.headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = do_POST = _serve

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def serve() -> Iterator[Callable[[MetadataApp], str]]:
    """serve(app) -> http://127.0.0.1:PORT, a threaded loopback server for the test."""
    servers: list[ThreadingHTTPServer] = []

    def start(app: MetadataApp) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        server.daemon_threads = True
        server.app = app  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def raw_request(url: str, method: str = "GET", headers: dict[str, str] | None = None) -> int:
    """Status of a request made without any source logic."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with opener.open(req, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def spec(kind: str, endpoint: str | None = None, **kw: Any) -> NoticeSourceSpec:
    return NoticeSourceSpec(kind=kind, endpoint=endpoint, **kw)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- spec and registry -------------------------------------------------------------------


@pytest.mark.unit
def test_registry_lists_every_source() -> None:
    assert source_names() == ["aws", "azure", "gcp", "ray-drain", "sigterm"]


@pytest.mark.unit
def test_unknown_kind_suggests_and_lists_valid_names() -> None:
    with pytest.raises(ValidationError) as e:
        spec("ray_drain")
    msg = str(e.value)
    assert "unknown notice source 'ray_drain'" in msg
    assert "did you mean 'ray-drain'?" in msg
    assert "valid kinds: aws, azure, gcp, ray-drain, sigterm" in msg
    with pytest.raises(ValidationError, match="valid kinds: aws, azure"):
        spec("kubernetes")


@pytest.mark.unit
def test_spec_fields_are_validated() -> None:
    with pytest.raises(ValidationError, match="Extra inputs"):
        NoticeSourceSpec(kind="aws", pol_interval_s=1)
    with pytest.raises(ValidationError, match="greater than 0"):
        spec("gcp", poll_interval_s=0)
    with pytest.raises(ValidationError, match="http\\(s\\) base URL"):
        spec("aws", "169.254.169.254")
    with pytest.raises(ValidationError, match="GCS address host:port"):
        spec("ray-drain", "http://10.0.0.5:6379")
    with pytest.raises(ValidationError, match="takes no endpoint"):
        spec("sigterm", "http://127.0.0.1:1")
    with pytest.raises(ValidationError, match="repeats source 'gcp'"):
        PreemptionSpec(sources=[{"kind": "gcp"}, {"kind": "gcp"}])
    p = PreemptionSpec.model_validate(
        {"sources": [{"kind": "aws"}, {"kind": "ray-drain", "endpoint": "10.0.0.5:6379"}]}
    )
    assert p.jit_checkpoint_budget_s == 20.0 and p.sources[1].poll_interval_s == 1.0
    assert PreemptionSpec().sources == []


@pytest.mark.unit
def test_bad_endpoint_is_a_value_error_at_construction() -> None:
    for kind, bad in [("aws", "not a url"), ("gcp", "http://:0"), ("ray-drain", "x")]:
        raw = NoticeSourceSpec.model_construct(kind=kind, endpoint=bad, poll_interval_s=1.0)
        with pytest.raises(ValueError, match="endpoint"):
            make_source(raw)


@pytest.mark.unit
def test_default_endpoints_and_deadlines() -> None:
    assert make_source(spec("aws")).endpoint == "http://169.254.169.254"
    assert make_source(spec("gcp")).endpoint == "http://metadata.google.internal"
    assert make_source(spec("azure")).endpoint == "http://169.254.169.254"
    assert make_source(spec("gcp")).deadline_s == 30.0
    assert make_source(spec("aws")).deadline_s == 120.0
    assert make_source(spec("sigterm", default_deadline_s=25)).deadline_s == 25.0


# --- AWS IMDSv2 --------------------------------------------------------------------------


@pytest.mark.unit
def test_aws_spot_notice_over_imdsv2(serve: Callable[[MetadataApp], str]) -> None:
    imds = ImdsV2()
    url = serve(imds)
    # The server is strict IMDSv2: no token, no answer.
    assert raw_request(url + AwsSource.ACTION_PATH) == 401
    assert raw_request(url + AwsSource.TOKEN_PATH, "PUT") == 400  # TTL header missing
    imds.requests.clear()

    src = make_source(spec("aws", url), node_id=NODE)
    assert src.poll() is None  # 404: nothing scheduled
    assert src.poll() is None
    imds.action = {"action": "terminate", "time": "2026-11-30T06:00:00Z"}
    notice = src.poll()
    assert notice == Notice("aws", NODE, 1796018400.0, "spot instance-action: terminate", {})
    assert notice.detail == imds.action
    assert src.poll() == notice  # the same notice, poll after poll
    # One token for all of it: the token is reused while it is valid.
    assert imds.count("PUT") == 1
    assert imds.count("GET", AwsSource.ACTION_PATH) == 4


@pytest.mark.unit
def test_aws_refreshes_a_revoked_token_after_401(serve: Callable[[MetadataApp], str]) -> None:
    imds = ImdsV2()
    imds.action = {"action": "stop", "time": "2026-11-30T06:02:00+00:00"}
    src = make_source(spec("aws", serve(imds)))
    assert src.poll() is not None and imds.count("PUT") == 1
    imds.revoke_tokens()
    notice = src.poll()  # GET -> 401, PUT a new token, GET again
    assert notice is not None and notice.deadline == 1796018520.0
    assert notice.reason == "spot instance-action: stop"
    assert imds.count("PUT") == 2
    assert [m for m, _, _ in imds.requests[-3:]] == ["GET", "PUT", "GET"]
    assert imds.statuses[-3:] == [401, 200, 200]


@pytest.mark.unit
def test_aws_renews_the_token_before_its_ttl_runs_out(
    serve: Callable[[MetadataApp], str],
) -> None:
    now = [1000.0]  # one clock for the server's token and the source's
    imds = ImdsV2(clock=lambda: now[0])
    src = AwsSource(spec("aws", serve(imds)), token_ttl_s=1, clock=lambda: now[0])
    assert src.poll() is None and src.poll() is None
    assert imds.count("PUT") == 1
    now[0] += 1.05  # past the token's 1 s
    assert src.poll() is None
    assert imds.count("PUT") == 2
    assert 401 not in imds.statuses  # renewed ahead of time: never sent an expired token


# --- GCP ---------------------------------------------------------------------------------


@pytest.mark.unit
def test_gcp_preempted_flag(serve: Callable[[MetadataApp], str]) -> None:
    md = GcpMetadata()
    url = serve(md)
    assert raw_request(url + GcpMetadata.PATH) == 403  # the header is required
    assert raw_request(url + GcpMetadata.PATH, headers={"Metadata-Flavor": "Google"}) == 200

    src = make_source(spec("gcp", url, default_deadline_s=30), node_id=NODE)
    assert src.poll() is None  # FALSE
    md.preempted = True
    before = time.time()
    notice = src.poll()
    assert notice is not None and notice.source == "gcp" and notice.node_id == NODE
    assert before + 30 <= notice.deadline <= time.time() + 30
    time.sleep(0.05)
    assert src.poll() == notice  # the deadline is anchored at the first TRUE
    assert all(h.get("metadata-flavor") == "Google" for _, _, h in md.requests[2:])


@pytest.mark.unit
def test_gcp_ignores_answers_without_metadata_flavor(serve: Callable[[MetadataApp], str]) -> None:
    impostor = GcpMetadata(genuine=False)
    impostor.preempted = True
    src = make_source(spec("gcp", serve(impostor)))
    assert src.poll() is None
    assert impostor.count("GET") == 1


# --- Azure -------------------------------------------------------------------------------


@pytest.mark.unit
def test_azure_reports_preempt_and_ignores_other_events(
    serve: Callable[[MetadataApp], str],
) -> None:
    imds = AzureImds(vm_name="spot-vm-1")
    url = serve(imds)
    events_url = url + "/metadata/scheduledevents?api-version=2020-07-01"
    assert raw_request(events_url) == 400  # Metadata: true is required
    assert raw_request(events_url, headers={"Metadata": "true"}) == 200

    src = make_source(spec("azure", url), node_id=NODE)
    assert src.poll() is None  # no events
    imds.add_event("Freeze", ["spot-vm-1"], time.time() + 900.0)
    imds.add_event("Reboot", ["spot-vm-1"], time.time() + 900.0)
    assert src.poll() is None  # maintenance, not preemption
    imds.add_event("Preempt", ["other-vm-7"], time.time() + 30.0)
    assert src.poll() is None  # another VM of the scale set
    imds.add_event("Preempt", ["spot-vm-1"], "Mon, 19 Sep 2016 18:29:47 GMT")
    notice = src.poll()
    assert notice is not None
    assert notice.deadline == datetime(2016, 9, 19, 18, 29, 47, tzinfo=timezone.utc).timestamp()
    assert notice.source == "azure" and notice.node_id == NODE
    assert notice.detail["EventType"] == "Preempt"
    assert notice.detail["DocumentIncarnation"] == imds.incarnation
    assert imds.count("GET", "/metadata/instance/compute/name") == 1  # asked once


# --- unreachable endpoints ---------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["aws", "gcp", "azure"])
def test_unreachable_endpoint_is_no_notice(kind: str) -> None:
    src = make_source(spec(kind, f"http://127.0.0.1:{closed_port()}"))
    assert src.poll() is None
    assert src.poll_all() == []


@pytest.mark.unit
def test_ray_drain_with_unreachable_gcs_is_no_notice() -> None:
    src = make_source(spec("ray-drain", f"127.0.0.1:{closed_port()}"))
    assert src.poll() is None


# --- SIGTERM -----------------------------------------------------------------------------


@pytest.fixture
def restore_sigterm() -> Iterator[None]:
    original = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, original)


def _wait_for(pred: Callable[[], Any], timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.01)
    return pred()


@pytest.mark.unit
def test_sigterm_becomes_a_notice(restore_sigterm: None) -> None:
    original = signal.getsignal(signal.SIGTERM)
    src = make_source(spec("sigterm", default_deadline_s=25), node_id=NODE)
    assert isinstance(src, SigtermSource)
    src.install()
    assert src.poll() is None
    before = time.time()
    os.kill(os.getpid(), signal.SIGTERM)  # we survive it: that is the point
    notice = _wait_for(src.poll)
    assert notice is not None and notice.reason == "SIGTERM" and notice.node_id == NODE
    assert before + 25 <= notice.deadline <= time.time() + 25
    os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM keeps the first deadline
    time.sleep(0.05)
    assert src.poll() == notice
    src.uninstall()
    assert signal.getsignal(signal.SIGTERM) is original


@pytest.mark.unit
def test_sigterm_install_needs_the_main_thread(restore_sigterm: None) -> None:
    src = make_source(spec("sigterm"))
    errors: list[BaseException] = []

    def install() -> None:
        try:
            src.install()  # type: ignore[attr-defined]
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=install)
    t.start()
    t.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])


# --- watcher -----------------------------------------------------------------------------


class ScriptedSource(NoticeSource):
    """Returns queued answers in turn (the last one repeats); may raise."""

    name = "scripted"

    def __init__(self, answers: list[Any], poll_interval_s: float = 0.01) -> None:
        self.answers = list(answers)
        self.poll_interval_s = poll_interval_s
        self.node_id = None
        self.endpoint = None
        self.polls = 0
        self.opened = self.closed = False

    def poll(self) -> Notice | None:
        self.polls += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def open(self) -> None:
        self.opened = True

    def close(self) -> None:
        self.closed = True


@pytest.mark.unit
def test_watcher_reports_each_notice_once() -> None:
    a = Notice("scripted", NODE, 1000.0, "x", {"poll": 1})
    a_again = Notice("scripted", NODE, 1000.0, "x", {"poll": 2})  # detail does not count
    b = Notice("scripted", NODE, 1010.0, "x")  # the deadline moved: a new notice
    src = ScriptedSource([None, a, a_again, a, b, b])
    got: list[Notice] = []

    def accept(n: Notice) -> bool:
        got.append(n)
        return True

    w = NoticeWatcher([src], accept)
    for _ in range(6):
        w.poll_once()
    assert got == [a, b] and w.notices == [a, b]


@pytest.mark.unit
def test_a_notice_that_was_not_acknowledged_is_sent_again() -> None:
    """A dropped notify (the controller busy, the call lost) is re-sent at every poll
    until the receiver says it has it, even once the source stops reporting it."""
    a = Notice("scripted", NODE, 1000.0, "x")
    src = ScriptedSource([a, None, None, None])
    answers = iter([False, RuntimeError("controller unreachable"), True])
    got: list[Notice] = []

    def flaky(n: Notice) -> bool:
        got.append(n)
        answer = next(answers, True)
        if isinstance(answer, Exception):
            raise answer
        return answer

    w = NoticeWatcher([src], flaky)
    for _ in range(4):
        w.poll_once()
    assert got == [a, a, a]  # dropped, failed, accepted; then never again


@pytest.mark.unit
def test_watcher_thread_polls_dedupes_and_survives_errors() -> None:
    notice = Notice("scripted", NODE, 1000.0, "x")
    flaky = ScriptedSource([RuntimeError("boom"), None, notice])
    steady = ScriptedSource([None], poll_interval_s=0.05)
    got: list[Notice] = []

    def on_notice(n: Notice) -> bool:
        got.append(n)
        if len(got) == 1:
            raise RuntimeError("a callback error must not stop the watcher")
        return True

    w = NoticeWatcher([flaky, steady], on_notice)
    w.start()
    try:
        assert flaky.opened and steady.opened and w.running
        assert _wait_for(lambda: flaky.polls >= 20)
    finally:
        w.stop()
    assert not w.running and flaky.closed and steady.closed
    assert got == [notice, notice]  # the failed delivery was tried again, once
    assert 2 <= steady.polls < flaky.polls  # each source on its own interval


@pytest.mark.unit
def test_watcher_over_real_sources(
    serve: Callable[[MetadataApp], str], restore_sigterm: None
) -> None:
    md = GcpMetadata()
    gcp = make_source(spec("gcp", serve(md), poll_interval_s=0.02), node_id=NODE)
    sig = make_source(spec("sigterm", poll_interval_s=0.02), node_id=NODE)
    got: list[Notice] = []
    with NoticeWatcher([gcp, sig], lambda n: got.append(n) or True):
        assert sig.installed  # type: ignore[attr-defined]
        assert _wait_for(lambda: md.count("GET") >= 3)  # several polls
        assert got == []
        md.preempted = True
        assert _wait_for(lambda: len(got) == 1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert _wait_for(lambda: len(got) == 2)
        polled = md.count("GET")
        assert _wait_for(lambda: md.count("GET") >= polled + 5)  # several more: nothing new
    assert [n.source for n in got] == ["gcp", "sigterm"]
    assert not sig.installed  # type: ignore[attr-defined]


# --- Ray node drain (chaos: a real multi-node cluster, in a subprocess) ------------------

_DRAIN_SECONDS = 40
_RESULT_MARK = "DRAIN-SCENARIO-RESULT "


def _drain_scenario(drain_seconds: int) -> dict[str, Any]:
    """Head + one 'spot' node; drain the spot node like `ray drain-node`; poll the source."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    try:
        spot = cluster.add_node(num_cpus=1, resources={"spot": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)

        # A drained node that is idle exits at once; keep the spot node busy so it
        # stays draining until its deadline, as a node running training would.
        @ray.remote(num_cpus=0, resources={"spot": 1})
        class Pin:
            def node(self) -> str:
                return ray.get_runtime_context().get_node_id()

        pin = Pin.remote()
        assert ray.get(pin.node.remote()) == spot.node_id

        one = make_source(
            spec("ray-drain", cluster.address, poll_interval_s=0.1), node_id=spot.node_id
        )
        every = make_source(spec("ray-drain", poll_interval_s=0.1))  # via ray.init's client
        watched: list[Notice] = []
        watcher = NoticeWatcher([every], lambda n: watched.append(n) or True)
        watcher.start()
        before = {"one": one.poll(), "every": every.poll_all()}

        t0 = time.time()
        cli = subprocess.run(
            [sys.executable, "-m", "ray.scripts.scripts", "drain-node"]
            + ["--address", cluster.address, "--node-id", spot.node_id]
            + ["--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot test"]
            + ["--deadline-remaining-seconds", str(drain_seconds)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        t1 = time.time()
        notice = _wait_for(one.poll, timeout=10)
        time.sleep(0.5)  # let the watcher poll several more times
        watcher.stop()
        return {
            "cli_rc": cli.returncode,
            "cli_err": cli.stderr[-2000:],
            "spot": spot.node_id,
            "head": cluster.head_node.node_id,
            "t0": t0,
            "t1": t1,
            "before_one": before["one"] is not None,
            "before_every": len(before["every"]),
            "notice": None if notice is None else notice.__dict__,
            "every": [n.__dict__ for n in every.poll_all()],
            "watched": [n.__dict__ for n in watched],
        }
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.chaos
def test_ray_drain_reports_the_drained_node_and_its_deadline() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    proc = subprocess.run(
        [sys.executable, __file__, "drain-scenario", str(_DRAIN_SECONDS)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_RESULT_MARK)]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    r = json.loads(lines[-1][len(_RESULT_MARK) :])
    assert r["cli_rc"] == 0, r["cli_err"]
    assert not r["before_one"] and r["before_every"] == 0

    n = r["notice"]
    assert n is not None, "the drained node never showed up as draining"
    assert n["source"] == "ray-drain" and n["node_id"] == r["spot"]
    # `ray drain-node` computes the deadline between t0 and t1 (ms precision).
    assert r["t0"] + _DRAIN_SECONDS - 1 <= n["deadline"] <= r["t1"] + _DRAIN_SECONDS + 1
    assert n["detail"]["deadline_timestamp_ms"] == round(n["deadline"] * 1000)

    # Watching every node: only the spot node drains, and the watcher reports it once.
    assert [e["node_id"] for e in r["every"]] == [r["spot"]]
    assert [w["node_id"] for w in r["watched"]] == [r["spot"]]
    assert r["watched"][0]["deadline"] == n["deadline"]


@pytest.mark.unit
def test_every_node_gets_its_own_watcher_name_even_with_a_shared_id_prefix():
    """Ray's fake provider numbers its nodes ffff...00001, ffff...00002: a name cut to a
    prefix would make the second node's watcher replace the first's."""
    from spotline.runtime.watchers import watcher_name

    a, b = "f" * 51 + "00001", "f" * 51 + "00002"
    assert watcher_name("job", a) != watcher_name("job", b)


if __name__ == "__main__" and sys.argv[1:2] == ["drain-scenario"]:
    result = _drain_scenario(int(sys.argv[2]))
    print(_RESULT_MARK + json.dumps(result, default=str), flush=True)
