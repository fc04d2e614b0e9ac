"""Cutting a rank's communicators (`spotline.train.comms`), in one process: the gloo cut
shuts only the connections it listed, a failing connection listing never replaces the
step's error, and the NCCL abort ends the process rather than hang.
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
from spotline.train.comms import GlooLinks, NcclAbort, comms_for

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

    assert links.abort() == 0
    assert _talks(client, accepted) and _talks(accepted, client)


def test_the_connection_it_listed_is_shut(pair):
    client, accepted = pair
    links = GlooLinks(0, connections=lambda: [_listed(client)])
    links.listeners = {("127.0.0.1", accepted.getsockname()[1])}

    assert links.abort() == 1
    accepted.settimeout(5)
    assert accepted.recv(4) == b""  # the peer sees the connection close
    links.abort()  # again: safe


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

        def get(self, key):
            return store[key]

    def connections():
        raise psutil.AccessDenied(pid=1)

    links = GlooLinks(0, connections=connections)
    links.begin()
    links.agree(Store(), 1, 5.0)
    assert links.listeners == set()


class _FakeGroup:
    """A process group whose abort returns, or blocks until released."""

    def __init__(self, hang: bool):
        self.hang = hang
        self.aborts = 0
        self.release = threading.Event()

    def abort(self) -> bool:
        self.aborts += 1
        if self.hang:
            self.release.wait()
        return True


def test_nccl_abort_is_called_through_the_interface_once():
    group, exits = _FakeGroup(hang=False), []
    comms = NcclAbort(4, abort_groups=group.abort, exit_process=exits.append)
    comms.begin()
    comms.agree(None, 8, 1.0)  # nothing to agree on NCCL
    assert comms.abort() == 1
    assert comms.abort() == 0
    assert group.aborts == 1 and exits == []
    assert isinstance(comms_for("nccl", 4), NcclAbort)


def test_an_nccl_abort_that_hangs_ends_the_process(caplog):
    group, exits = _FakeGroup(hang=True), []
    comms = NcclAbort(5, abort_groups=group.abort, exit_process=exits.append, timeout_s=0.05)
    try:
        with caplog.at_level(logging.CRITICAL, logger="spotline.comms"):
            assert comms.abort() == 0
        assert exits == [1]
        assert "rank 5" in caplog.text and "ending its process" in caplog.text
    finally:
        group.release.set()


def test_an_nccl_abort_that_raises_is_reported_not_raised():
    def abort():
        raise ValueError("Invalid process group specified or has been destroyed.")

    exits = []
    assert NcclAbort(1, abort_groups=abort, exit_process=exits.append).abort() == 0
    assert exits == []


def test_hand_overs_other_reasons():
    assert why_not_kept(True, True, None, 2.0) == "its node goes"
    assert why_not_kept(False, False, None, 2.0).startswith("still in its step")
    assert why_not_kept(False, True, None, 2.0) is None

    class ActorDiedError(Exception):
        pass

    assert why_not_kept(False, True, ActorDiedError(), 2.0) == "its process died"
