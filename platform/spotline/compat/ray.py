"""Ray's private names that Spotline uses: one function per need, checked at import.

Ray's core names (services, state, the GCS client, the autoscaler's protobufs, the
runtime_env uploads) load with `import ray` and are looked up here. Ray Data's
autoscaling coordinator and Ray Tune's PBT scheduler are checked in Ray's source: each
costs about a second to import, which every importer of this seam would pay; they are
imported by the function that uses them.
"""

from __future__ import annotations

from typing import Any

import ray

from spotline.compat import Pinned

PIN = "ray==2.60.0"  # pyproject.toml's
_ray = Pinned("ray", ray.__version__, PIN)

_constants = _ray.module("ray._private.ray_constants", "ENABLE_RAY_CLUSTER")
_services = _ray.module(
    "ray._private.services",
    "find_gcs_addresses",
    "get_ray_address_from_environment",
    "parse_address",
    "resolve_ip_for_localhost",
    "canonicalize_bootstrap_address",
)
_state = _ray.module("ray._private.state", "available_resources_per_node")
_node = _ray.module("ray._private.node", "Node.live_processes")
_worker = _ray.module("ray._private.worker", "global_worker")
_raylet = _ray.module(
    "ray._raylet",
    "GcsClient",
    "InnerGcsClient.get_draining_nodes",
    "InnerGcsClient.drain_node",
)
_PREEMPTION = _ray.attribute("ray.core.generated.autoscaler_pb2", "DrainNodeReason").Value(
    "DRAIN_NODE_REASON_PREEMPTION"
)
_py_modules = _ray.module("ray._private.runtime_env.py_modules", "upload_py_modules_if_needed")
_working_dir = _ray.module("ray._private.runtime_env.working_dir", "upload_working_dir_if_needed")

_COORDINATOR = "ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator"
_PRIORITY = "ray.data._internal.cluster_autoscaler.base_autoscaling_coordinator"
_ray.defined(
    _COORDINATOR,
    "get_or_create_autoscaling_coordinator",
    "_AutoscalingCoordinatorActor.request_resources",
    "_AutoscalingCoordinatorActor.cancel_request",
)
_ray.defined(_PRIORITY, "ResourceRequestPriority.HIGH")
_ray.defined("ray.tune.schedulers.pbt", "PopulationBasedTraining._hyperparam_mutations")
_ray.defined("ray._private.parameter", "RayParams._system_config")


# --- finding and reaching a cluster --------------------------------------------------------


def listen_on_loopback_only() -> None:
    """Make every Ray node this process starts from now on a single-machine cluster,
    which binds to 127.0.0.1 (`ray_constants.ENABLE_RAY_CLUSTER`, read each time Ray
    resolves the node IP)."""
    _constants.ENABLE_RAY_CLUSTER = False


def local_gcs_addresses() -> set[str]:
    """The GCS address of every Ray cluster running on this machine."""
    return set(_services.find_gcs_addresses())


def address_from_environment(address: str) -> str:
    """What Ray connects to for `address` ("auto": RAY_ADDRESS, else the latest local
    cluster); raises when there is none."""
    return _services.get_ray_address_from_environment(address, None)


def parse_address(address: str) -> tuple[str, str] | None:
    """`address` as (host, port), as Ray splits it."""
    return _services.parse_address(address)


def node_ip_for(host: str) -> str:
    """The IP Ray dials for `host`: the node's own IP for a loopback name, else `host`."""
    return _services.resolve_ip_for_localhost(host)


def bootstrap_address() -> str | None:
    """The GCS address a process outside the cluster would attach to (RAY_ADDRESS, else
    the latest local cluster's), or None."""
    return _services.canonicalize_bootstrap_address(None)


# --- the GCS -------------------------------------------------------------------------------


def gcs_client(address: str | None = None) -> Any:
    """A client of the GCS at `address`; None: the one this process is connected with
    (`ray.init` done)."""
    if address is None:
        return _worker.global_worker.gcs_client
    return _raylet.GcsClient(address=address)


def draining_nodes(timeout_s: float, client: Any = None) -> dict[str, int]:
    """Node id -> drain deadline (ms since the epoch; 0: none given) of every node Ray
    is draining, from `client` (default: this process's)."""
    return dict((client or gcs_client()).get_draining_nodes(timeout=timeout_s))


def drain_for_preemption(node_id: str, reason: str, deadline_s: float) -> tuple[bool, str]:
    """Ask Ray to drain `node_id`, which its cloud takes away at `deadline_s` (epoch
    seconds): nothing new is placed there. (accepted, why not)."""
    accepted, why = gcs_client().drain_node(node_id, _PREEMPTION, reason, int(deadline_s * 1000))
    return bool(accepted), why


def node_pids(node: Any) -> list[int]:
    """The pids of the processes a `ray.cluster_utils.Cluster` node started (its raylet
    and the rest), without their children (the workers the raylet starts)."""
    return [p.pid for _, p in node.live_processes()]


def head_with_system_config(head: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The head-node arguments of a `ray.cluster_utils.Cluster` with Ray's system config
    `config` (its private `_system_config`, which the head gives every node)."""
    return {**head, "_system_config": dict(config)}


def free_resources_per_node() -> dict[str, dict[str, float]]:
    """Node id -> the resources free on it now."""
    return _state.available_resources_per_node()


# --- jobs ----------------------------------------------------------------------------------


def upload_py_modules_if_needed(runtime_env: dict, include_gitignore: bool = True) -> dict:
    """`runtime_env` with its local `py_modules` uploaded to the cluster (as `ray.init`
    does for a job's own); `include_gitignore`: leave out what .gitignore names."""
    return _py_modules.upload_py_modules_if_needed(runtime_env, include_gitignore=include_gitignore)


def upload_working_dir_if_needed(runtime_env: dict, include_gitignore: bool = True) -> dict:
    """`runtime_env` with its local `working_dir` uploaded to the cluster (as `ray.init`
    does for a job's own); `include_gitignore`: leave out what .gitignore names."""
    return _working_dir.upload_working_dir_if_needed(
        runtime_env, include_gitignore=include_gitignore
    )


def autoscaling_coordinator() -> Any:
    """The actor of Ray's autoscaling coordinator (Ray Data's and Ray Train's): it merges
    the resource requests of every requester and lets each lapse when not refreshed."""
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    return get_or_create_autoscaling_coordinator()


def request_resources(
    coordinator: Any, requester: str, bundles: list[dict[str, float]], expire_after_s: float
) -> Any:
    """Ask `coordinator` for `bundles` on behalf of `requester`, at high priority, until
    `expire_after_s` pass without another request; the call's ObjectRef."""
    from ray.data._internal.cluster_autoscaler.base_autoscaling_coordinator import (
        ResourceRequestPriority,
    )

    return coordinator.request_resources.remote(
        requester_id=requester,
        resources=bundles,
        expire_after_s=expire_after_s,
        priority=ResourceRequestPriority.HIGH,
    )


def cancel_request(coordinator: Any, requester: str) -> Any:
    """Withdraw what `requester` asked `coordinator` for; the call's ObjectRef."""
    return coordinator.cancel_request.remote(requester_id=requester)


def pbt_hyperparam_mutations(scheduler: Any) -> dict:
    """The `hyperparam_mutations` a PopulationBasedTraining scheduler was built with."""
    return dict(scheduler._hyperparam_mutations)
