"""What each rank of a group runs on, and how the ranks find each other.

Pure functions (no Ray, no torch) so that every rule here is tested without a cluster:
- the group's device, decided at every group start from the nodes it can use, never
  by falling back: `device: gpu` waits for GPUs, a group is never part CPU, part GPU;
- the devices a node's ranks share (as Ray Train does): every rank of a node sees the
  union of that node's GPUs, and its LOCAL_RANK is the index of its own GPU in it, so
  NCCL's intra-node transports (P2P, NVLS) see the peers while each rank drives one;
- the environment that reaches every rank (socket interfaces for NCCL and gloo);
- the init URL, with IPv6 literals bracketed.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from spotline.config.loader import SpecError


class DeviceMixError(SpecError):
    """Some ranks of one group got a GPU and others did not."""


def decide_device(requested: str, nodes: Iterable[Mapping[str, float]]) -> str:
    """The device a group runs on: 'gpu' or 'cpu'.

    `nodes`: the total resources of each node the group may be placed on (alive and not
    draining). 'gpu' and 'cpu' are taken as asked: a 'gpu' group with no GPU node waits
    for one rather than running on CPU. 'auto' is 'gpu' as soon as one of those nodes
    has a GPU (the group is then placed on GPU nodes only), 'cpu' otherwise; it is
    decided again at each group start, so a job that began on CPU moves to GPUs at its
    next restart once they are there."""
    if requested in ("gpu", "cpu"):
        return requested
    if requested != "auto":
        raise ValueError(f"resources.device must be auto, gpu or cpu, not {requested!r}")
    return "gpu" if any(n.get("GPU", 0) > 0 for n in nodes) else "cpu"


def check_one_device(device: str, gpu_ids: Sequence[Sequence[Any]]) -> None:
    """Refuse a group whose ranks do not all run on `device`. `gpu_ids[r]`: the GPU ids
    Ray gave rank r (`ray.get_gpu_ids()`)."""
    on_gpu = [r for r, ids in enumerate(gpu_ids) if ids]
    on_cpu = [r for r, ids in enumerate(gpu_ids) if not ids]
    if device == "gpu" and on_cpu or device == "cpu" and on_gpu or (on_gpu and on_cpu):
        raise DeviceMixError(
            f"the group was to run on {device}, but ranks {_ranks(on_gpu)} got a GPU and "
            f"ranks {_ranks(on_cpu)} did not: one group never mixes CPU and GPU workers; "
            "set resources.device to gpu (waits for GPU nodes) or cpu"
        )


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) if ranks else "none"


def _gpu_key(gpu_id: Any) -> tuple[int, Any]:
    # Numeric ids in numeric order ("10" after "9"); UUIDs (MIG, GPU-...) by name.
    s = str(gpu_id)
    return (0, int(s)) if s.isdigit() else (1, s)


def share_node_devices(ranks: Sequence[tuple[str, Sequence[Any]]]) -> list[tuple[int, str | None]]:
    """Per rank, (LOCAL_RANK, CUDA_VISIBLE_DEVICES or None to leave it as Ray set it).

    `ranks[r]` = (node id, the GPU ids Ray gave rank r). On GPUs every rank of a node sees
    the sorted union of the node's ranks' GPUs and its local rank is the index of its
    own GPU in that list: torch.cuda.set_device(local_rank) drives its own device.
    Without GPUs the local rank is the rank's place among its node's ranks."""
    union: dict[str, list[str]] = {}
    for node, ids in ranks:
        seen = union.setdefault(node, [])
        seen.extend(str(i) for i in ids if str(i) not in seen)
    for ids in union.values():
        ids.sort(key=_gpu_key)
    out: list[tuple[int, str | None]] = []
    count: dict[str, int] = {}
    for node, ids in ranks:
        if ids:
            if len(ids) != 1:
                raise ValueError(f"a rank drives exactly one GPU, this one was given {list(ids)}")
            out.append((union[node].index(str(ids[0])), ",".join(union[node])))
        else:
            out.append((count.get(node, 0), None))
        count[node] = count.get(node, 0) + 1
    return out


def worker_env(
    device: str, local_rank: int, visible: str | None, socket_ifname: str | None
) -> dict[str, str]:
    """The environment a rank sets before torch or DeepSpeed touch a device.

    `socket_ifname` (resources.socket_ifname, or the interface of the node's own Ray
    address when unset) names the interface(s) NCCL and gloo bind and connect on;
    without it gloo binds to whatever the hostname resolves to, loopback in many
    containers. A CPU group hides the node's GPUs and pins DeepSpeed to its CPU
    accelerator: a rank on a GPU node still runs the device its group was started on."""
    env = {"LOCAL_RANK": str(local_rank)}
    if device == "cpu":
        visible = ""
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    if socket_ifname:
        env["GLOO_SOCKET_IFNAME"] = socket_ifname
        env["NCCL_SOCKET_IFNAME"] = socket_ifname
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    return env


def host_for_url(host: str) -> str:
    """`host` as it goes in a URL's authority: IPv6 literals bracketed."""
    bare = host.strip("[]")
    try:
        if ipaddress.ip_address(bare.split("%", 1)[0]).version == 6:
            return f"[{bare}]"
    except ValueError:
        pass  # a hostname
    return host


def rendezvous_url(host: str, port: int) -> str:
    """The tcp:// init URL of a rendezvous at host:port (IPv4, IPv6 or a hostname)."""
    return f"tcp://{host_for_url(host)}:{int(port)}"


def interface_of(ip: str, addrs: Mapping[str, Iterable[Any]] | None = None) -> str | None:
    """The name of the network interface that holds address `ip` (None when no local
    interface does). `addrs`: psutil.net_if_addrs() (read here when not given)."""
    if addrs is None:
        import psutil

        addrs = psutil.net_if_addrs()
    try:
        want = ipaddress.ip_address(ip.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    for name, entries in addrs.items():
        for a in entries:
            try:
                if ipaddress.ip_address(str(a.address).split("%", 1)[0]) == want:
                    return name
            except ValueError:
                continue  # a MAC address
    return None
