"""Cutting a rank's communicators (`spotline.train.comms`), in one process: the gloo cut
shuts only the connections it listed, a failing connection listing never replaces the
step's error, the NCCL abort runs once on a thread of its own and is reported, not
waited on, when it hangs, and a rank whose GPU hit a sticky CUDA error (or whose abort
hung) is never kept for the next group. NCCL itself does not run here: the abort is
an injected function.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections import namedtuple

import psutil
import pytest

from spotline.controller.policies import classify
from spotline.runtime.group import why_not_kept
from spotline.runtime.progress import describe_failure
from spotline.train.comms import Cut, GlooLinks, NcclAbort, comms_for
from spotline.train.process import sticky_cuda_error
from spotline.train.watch import CommsHung

pytestmark = pytest.mark.unit

Addr = namedtuple("Addr", "ip port")
Conn = namedtuple("Conn", "fd laddr raddr status")


@pytest.fixture
def pair():
    """A connected TCP pair on loopback (an unrelated connection of the process)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
    yield client, accepted
    client.close()
    accepted.close()


def _listed(sock: socket.socket, laddr=None, raddr=None) -> Conn:
    """`sock` as psutil lists a connection (by default: as it is now)."""
    own, peer = sock.getsockname(), sock.getpeername()
    return Conn(
        sock.fileno(),
        laddr or Addr(own[0], own[1]),
        raddr or Addr(peer[0], peer[1]),
        psutil.CONN_ESTABLISHED,
    )


def _talks(a: socket.socket, b: socket.socket) -> bool:
    a.sendall(b"ping")
    b.settimeout(5)
    return b.recv(4) == b"ping"


def test_a_stale_entry_whose_fd_number_was_reused_is_not_shut(pair):
    client, accepted = pair
    # psutil listed a gloo link (to a peer's listener, port 29511) under this fd number;
    # gloo closed it since, and the number now holds the unrelated connection `client`.
    stale = _listed(client, raddr=Addr("127.0.0.1", 29511))
    links = GlooLinks(0, connections=lambda: [stale])
    links.listeners = {("127.0.0.1", 29511)}

    assert links.abort().n == 0
    assert _talks(client, accepted) and _talks(accepted, client)


def test_the_connection_it_listed_is_shut(pair):
    client, accepted = pair
    links = GlooLinks(0, connections=lambda: [_listed(client)])
    links.listeners = {("127.0.0.1", accepted.getsockname()[1])}

    assert links.abort().n == 1
    accepted.settimeout(5)
    assert accepted.recv(4) == b""  # the peer sees the connection close
    assert links.abort().n == 1  # again: safe, and says what the one cut did


@pytest.mark.parametrize(
    "listing_error",
    [psutil.AccessDenied(pid=1), PermissionError(13, "Permission denied"), RuntimeError("x")],
)
def test_a_listing_error_in_the_cut_leaves_the_failure_and_its_classification(listing_error):
    def connections():
        raise listing_error

    links = comms_for("gloo", 2)
    links._connections = connections
    step_error = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    expected = classify([step_error])

    with pytest.raises(RuntimeError) as raised:
        try:  # the failure path of a rank's run
            raise step_error
        except BaseException:
            links.abort()
            raise
    assert raised.value is step_error
    assert classify([raised.value]) == expected
    assert expected.retryable  # a lost peer: transient, not "permission denied"


def test_a_listing_error_while_joining_still_publishes_for_the_peers():
    store = {}

    class Store:
        def set(self, key, value):
            store[key] = value.encode()

        def wait(self, keys, timeout):
            assert all(k in store for k in keys)

        def multi_get(self, keys):
            return [store[k] for k in keys]

    def connections():
        raise psutil.AccessDenied(pid=1)

    links = GlooLinks(0, connections=connections)
    links.begin()
    links.agree(Store(), 1, 5.0)
    assert links.listeners == set()


class _FakeGroup:
    """A process group whose abort returns, or blocks until released; it records the
    thread each abort ran on."""

    def __init__(self, hang: bool):
        self.hang = hang
        self.aborts = 0
        self.threads: list[str] = []
        self.release = threading.Event()

    def abort(self) -> bool:
        self.aborts += 1
        self.threads.append(threading.current_thread().name)
        if self.hang:
            self.release.wait()
        return True


def test_nccl_abort_is_called_through_the_interface_once_on_its_own_thread():
    group = _FakeGroup(hang=False)
    comms = NcclAbort(4, abort_groups=group.abort)
    comms.begin()
    comms.agree(None, 8, 1.0)  # nothing to agree on NCCL
    assert comms.abort() == Cut(1)
    assert comms.abort() == Cut(1)  # the same abort's outcome, not a second abort
    assert group.aborts == 1 and comms.hung is None
    assert group.threads == ["spotline-abort-4"]  # not the caller's thread
    assert isinstance(comms_for("nccl", 4), NcclAbort)


def test_an_nccl_abort_that_hangs_is_reported_and_the_process_lives(caplog):
    group = _FakeGroup(hang=True)
    comms = NcclAbort(5, "node-abc", abort_groups=group.abort, timeout_s=0.05)
    try:
        with caplog.at_level(logging.CRITICAL, logger="spotline.comms"):
            cut = comms.abort()
        assert cut.n == 0 and isinstance(cut.hung, CommsHung)
        assert comms.hung is cut.hung and cut.hung.node == "node-abc"
        said = str(cut.hung)
        assert "rank 5 on node node-abc" in said and "SPOTLINE_COMM_ABORT_TIMEOUT_S" in said
        assert "aborting its NCCL communicators" in said and "cordoned" in said
        assert caplog.text.count("did not return") == 1
        # A second caller (the restart asking while the step's abort hangs) gets the
        # same verdict at once, and nothing more is said.
        assert comms.abort().hung is cut.hung
        assert caplog.text.count("did not return") == 1 and group.aborts == 1
    finally:
        group.release.set()


def test_a_hung_abort_crosses_ray_as_itself_and_names_the_steps_error():
    import pickle

    hung = CommsHung(3, "node-abc", "aborting its NCCL communicators", 30.0, "KNOB")
    step = RuntimeError("NCCL communicator was aborted on rank 3.\nmore")
    back = pickle.loads(pickle.dumps(hung.after(step)))
    assert isinstance(back, CommsHung) and (back.rank, back.node) == (3, "node-abc")
    assert "after its step failed (RuntimeError: NCCL communicator was aborted" in str(back)
    # Not taken for a hang of the step: it names no collective timeout of its own.
    assert classify([back]).name == "transient"
    assert why_not_kept(False, True, _RayTaskError(back), 2.0).startswith("hung: aborting")


def test_an_nccl_abort_that_raises_is_reported_not_raised():
    def abort():
        raise ValueError("Invalid process group specified or has been destroyed.")

    assert NcclAbort(1, abort_groups=abort).abort() == Cut(0)


_CUDA_HINTS = (
    "\nCUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\nFor debugging consider passing "
    "CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side "
    "assertions.\n"
)


@pytest.mark.parametrize(
    "text",
    [
        "CUDA error: an illegal memory access was encountered" + _CUDA_HINTS,
        "CUDA error: misaligned address" + _CUDA_HINTS,
        "CUDA error: unspecified launch failure" + _CUDA_HINTS,
        "CUDA error: device-side assert triggered" + _CUDA_HINTS,
        "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with "
        "NCCL_DEBUG=INFO for details), NCCL version 2.27.3\nncclUnhandledCudaError: Call "
        "to CUDA function failed.\nLast error:\nCuda failure 'an illegal memory access was "
        "encountered'",
    ],
)
def test_sticky_cuda_errors_are_recognised_and_never_kept(text):
    error = RuntimeError(text)
    assert sticky_cuda_error(text) is not None
    why = why_not_kept(node_goes=False, returned=True, error=error, grace_s=2.0)
    assert why is not None and "sticky CUDA error" in why
    assert "CUDA error" in describe_failure(error)  # not torch's last debugging hint


class _RayTaskError(Exception):
    """How Ray hands back a rank's error: the rank's own as `cause`."""

    def __init__(self, cause):
        super().__init__("ray task failed")
        self.cause = cause


@pytest.mark.parametrize(
    "text",
    [
        "CUDA out of memory. Tried to allocate 2.00 GiB",
        "CUDA error: invalid argument",
        "[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.3]:4242",
        "NCCL communicator was aborted on rank 3.",
    ],
)
def test_other_errors_leave_the_rank_kept(text):
    assert sticky_cuda_error(text) is None
    error = _RayTaskError(RuntimeError(text))
    assert why_not_kept(node_goes=False, returned=True, error=error, grace_s=2.0) is None


def test_a_sticky_error_behind_rays_wrapper_is_not_kept():
    error = _RayTaskError(RuntimeError("CUDA error: misaligned address" + _CUDA_HINTS))
    assert "misaligned address" in why_not_kept(False, True, error, 2.0)


def test_hand_overs_other_reasons():
    assert why_not_kept(True, True, None, 2.0) == "its node goes"
    assert why_not_kept(False, False, None, 2.0).startswith("still in its step")
    assert why_not_kept(False, True, None, 2.0) is None

    class ActorDiedError(Exception):
        pass

    assert why_not_kept(False, True, ActorDiedError(), 2.0) == "its process died"
