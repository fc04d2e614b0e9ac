"""How the ranks of a group find each other and what they run on (no Ray).

The device decision at each group start, the refusal of a CPU/GPU mix, the node's
GPUs shared with a true LOCAL_RANK, the environment every rank gets (socket
interfaces), the IPv6-safe init URL, and a rendezvous port that is never released
between being chosen and being listened on.
"""

from __future__ import annotations

import socket
import threading
from collections import namedtuple
from datetime import timedelta

import pytest

from spotline.config import load_spec
from spotline.config.loader import SpecError
from spotline.controller.policies import classify
from spotline.report import status_rows
from spotline.runtime.rendezvous import (
    DeviceMixError,
    check_one_device,
    decide_device,
    interface_of,
    rendezvous_url,
    share_node_devices,
    worker_env,
)

pytestmark = pytest.mark.unit

CPU_NODE = {"CPU": 8.0, "memory": 1e10}
GPU_NODE = {"CPU": 16.0, "GPU": 4.0, "accelerator_type:H100": 1.0}


# --- the device ------------------------------------------------------------------------


def test_auto_is_decided_from_the_nodes_the_group_can_use():
    assert decide_device("auto", [CPU_NODE]) == "cpu"
    assert decide_device("auto", []) == "cpu"
    # The head has no GPU; one GPU node joined: the next group starts on GPUs.
    assert decide_device("auto", [CPU_NODE, GPU_NODE]) == "gpu"


def test_gpu_never_falls_back_to_cpu():
    assert decide_device("gpu", [CPU_NODE]) == "gpu"
    assert decide_device("gpu", []) == "gpu"
    assert decide_device("cpu", [GPU_NODE]) == "cpu"


def test_a_group_that_mixes_cpu_and_gpu_workers_is_refused():
    check_one_device("gpu", [["0"], ["1"]])
    check_one_device("cpu", [[], []])
    with pytest.raises(DeviceMixError) as e:
        check_one_device("gpu", [["0"], [], ["1"], []])
    msg = str(e.value)
    assert "\n" not in msg
    assert "ranks 0, 2 got a GPU and ranks 1, 3 did not" in msg
    assert "resources.device" in msg
    with pytest.raises(DeviceMixError):
        check_one_device("cpu", [[], ["0"]])
    # A spec-level refusal: the controller fails the job with it, never retries.
    assert not classify([e.value]).retryable


def test_a_rank_given_a_gpu_whose_torch_has_no_cuda_fails_with_one_clear_line():
    import torch

    from spotline.train.process import use_device

    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA")
    use_device("cpu", 0, 3)  # nothing to take on CPU
    with pytest.raises(SpecError) as e:
        use_device("gpu", 1, 3)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("rank 3 was given a GPU by Ray")
    assert "cannot use CUDA" in msg and "resources.device: cpu" in msg
    assert not classify([e.value]).retryable


def test_the_status_says_which_device_the_group_runs_on():
    rows = dict(status_rows({"name": "j", "state": "running", "device": "gpu"}))
    assert rows["device"] == "GPU (nccl)"
    assert dict(status_rows({"name": "j", "device": "cpu"}))["device"] == "CPU (gloo)"
    assert dict(status_rows({"name": "j"}))["device"] == "-"


# --- the node's devices, shared ----------------------------------------------------------


def test_the_ranks_of_a_node_share_its_gpus_and_get_their_true_local_rank():
    # Ray gave each rank one GPU; ranks of two nodes interleaved, ids out of order.
    ranks = [("a", ["3"]), ("b", ["0"]), ("a", ["1"]), ("b", ["10"]), ("a", ["9"]), ("b", ["2"])]
    got = share_node_devices(ranks)
    assert got == [
        (1, "1,3,9"),
        (0, "0,2,10"),
        (0, "1,3,9"),
        (2, "0,2,10"),
        (2, "1,3,9"),
        (1, "0,2,10"),
    ]
    # Each rank drives exactly its own GPU: cuda:<local rank> of the shared list is it.
    for (_, ids), (local, visible) in zip(ranks, got, strict=True):
        assert visible.split(",")[local] == ids[0]
    # Numbers as Ray returns them (ints) and UUIDs (MIG) work too.
    assert share_node_devices([("n", [1]), ("n", [0])]) == [(1, "0,1"), (0, "0,1")]
    mig = [("n", ["MIG-b"]), ("n", ["MIG-a"])]
    assert share_node_devices(mig) == [(1, "MIG-a,MIG-b"), (0, "MIG-a,MIG-b")]


def test_cpu_ranks_are_numbered_within_their_node():
    got = share_node_devices([("a", []), ("b", []), ("a", []), ("a", [])])
    assert got == [(0, None), (0, None), (1, None), (2, None)]


# --- the environment every rank gets ----------------------------------------------------


def test_the_socket_interface_reaches_nccl_and_gloo():
    env = worker_env("gpu", 1, "0,1", "ens5,ens6")
    assert env == {
        "LOCAL_RANK": "1",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "GLOO_SOCKET_IFNAME": "ens5,ens6",
        "NCCL_SOCKET_IFNAME": "ens5,ens6",
    }
    assert "GLOO_SOCKET_IFNAME" not in worker_env("gpu", 0, "0", None)
    # A CPU group hides the node's GPUs: it runs the device its group was started on.
    cpu = worker_env("cpu", 2, None, "eth0")
    assert cpu["CUDA_VISIBLE_DEVICES"] == "" and cpu["DS_ACCELERATOR"] == "cpu"
    assert cpu["LOCAL_RANK"] == "2" and cpu["GLOO_SOCKET_IFNAME"] == "eth0"


def test_socket_ifname_is_a_resources_field():
    spec = load_spec({"resources": {"socket_ifname": "eth0,eth1"}})
    assert spec.resources.socket_ifname == "eth0,eth1"
    assert load_spec({}).resources.socket_ifname is None
    with pytest.raises(SpecError, match="socket_ifname"):
        load_spec({"resources": {"socket_ifname": "eth0; rm -rf /"}})


def test_gloo_binds_to_the_interface_of_the_nodes_address_when_none_is_set():
    Addr = namedtuple("Addr", "address")
    addrs = {
        "lo": [Addr("127.0.0.1"), Addr("::1")],
        "eth0": [Addr("00:11:22:33:44:55"), Addr("10.0.0.7"), Addr("fe80::1%eth0")],
    }
    assert interface_of("10.0.0.7", addrs) == "eth0"
    assert interface_of("fe80::1", addrs) == "eth0"
    assert interface_of("::1", addrs) == "lo"
    assert interface_of("10.9.9.9", addrs) is None
    assert interface_of("not-an-ip", addrs) is None
    assert interface_of("127.0.0.1") is not None  # this host's own table


def test_the_worker_sets_that_environment_before_deepspeed_is_imported(monkeypatch):
    from spotline.runtime import actor as actor_mod
    from spotline.train.process import Topology

    monkeypatch.setattr(actor_mod.ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    order = []
    monkeypatch.setattr(actor_mod, "import_deepspeed", lambda: order.append(dict(env_now())))
    # setenv first, so the teardown also removes what bind() sets in this process
    # (delenv alone restores only keys that existed): a CUDA_VISIBLE_DEVICES="" left
    # behind breaks every later Ray node of the suite that declares GPUs.
    keys = ("LOCAL_RANK", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES")
    for k in (*keys, "DS_ACCELERATOR"):
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)

    def env_now():
        import os

        return {k: os.environ.get(k) for k in ("LOCAL_RANK", "GLOO_SOCKET_IFNAME")}

    w = actor_mod.TrainWorker.__new__(actor_mod.TrainWorker)
    w.topo = Topology(1, 2, 1)
    env = w.bind("cpu", 1, None, None)
    assert env["GLOO_SOCKET_IFNAME"] == interface_of("127.0.0.1")  # the node's own address
    assert order == [{"LOCAL_RANK": "1", "GLOO_SOCKET_IFNAME": env["GLOO_SOCKET_IFNAME"]}]
    assert (w.device, w.local_rank) == ("cpu", 1)
    env = w.bind("cpu", 0, None, "eth9")
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "eth9"


# --- the rendezvous ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host, url",
    [
        ("10.0.0.7", "tcp://10.0.0.7:29500"),
        ("fd00::7", "tcp://[fd00::7]:29500"),
        ("[fd00::7]", "tcp://[fd00::7]:29500"),
        ("fe80::1%eth0", "tcp://[fe80::1%eth0]:29500"),
        ("node-3.cluster.local", "tcp://node-3.cluster.local:29500"),
    ],
)
def test_the_init_url_brackets_ipv6_literals(host, url):
    assert rendezvous_url(host, 29500) == url


def _worker(rank: int, world: int):
    from spotline.config.schema import JobSpec
    from spotline.runtime.actor import TrainWorker
    from spotline.train.process import Topology

    w = TrainWorker.__new__(TrainWorker)
    w.topo = Topology(1, world, rank)
    w.spec = JobSpec()  # its failure.collective_timeout_s bounds the store's waits
    return w


def test_the_rendezvous_port_is_held_from_the_moment_it_is_handed_out():
    w = _worker(0, 2)
    port = w.host_store("127.0.0.1")
    # Nobody else can take it: it is listening already ...
    with pytest.raises(OSError), socket.socket() as s:
        s.bind(("127.0.0.1", port))
    # ... and a peer reaches the store on it.
    import torch.distributed as dist

    peer = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=10))
    peer.set("k", "v")
    assert w._store.get("k") == b"v"


def test_concurrent_stores_never_get_the_same_port():
    ports: list[int] = []
    lock = threading.Lock()
    workers = [_worker(0, 2) for _ in range(16)]

    def host(w):
        p = w.host_store("127.0.0.1")
        with lock:
            ports.append(p)

    # Meanwhile another process-like binder keeps grabbing ephemeral ports.
    grabbed: list[socket.socket] = []

    def grab():
        for _ in range(64):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen()
            grabbed.append(s)

    threads = [threading.Thread(target=host, args=(w,)) for w in workers]
    threads.append(threading.Thread(target=grab))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(set(ports)) == len(ports) == 16
        assert not set(ports) & {s.getsockname()[1] for s in grabbed}
    finally:
        for s in grabbed:
            s.close()
