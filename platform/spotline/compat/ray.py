"""Ray's private names that Spotline uses: one function per need, checked at import.

Ray's core names (services, state, the GCS client, the autoscaler's protobufs, the
runtime_env uploads) load with `import ray` and are looked up here. Ray Data's
autoscaling coordinator and Ray Tune's PBT scheduler are checked in Ray's source: each
costs about a second to import, which every importer of this seam would pay; they are
imported by the function that uses them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import ray

from spotline.compat import Pinned

PIN = "ray==2.60.0"  # pyproject.toml's
_ray = Pinned("ray", ray.__version__, PIN)

_constants = _ray.module(
    "ray._private.ray_constants", "ENABLE_RAY_CLUSTER", "PROMETHEUS_SERVICE_DISCOVERY_FILE"
)
_services = _ray.module(
    "ray._private.services",
    "find_gcs_addresses",
    "get_ray_address_from_environment",
    "parse_address",
    "resolve_ip_for_localhost",
    "canonicalize_bootstrap_address",
)
_state = _ray.module(
    "ray._private.state",
    "available_resources_per_node",
    "actors",
    "state",
    "GlobalState._connect_and_get_accessor",
)
_node = _ray.module("ray._private.node", "Node.live_processes", "Node.get_session_dir_path")
_ray.defined("ray._private.node", "Node.all_processes")
_parameter = _ray.module("ray._private.parameter", "RayParams")
_worker = _ray.module("ray._private.worker", "global_worker", "_global_node")
_kv = _ray.module("ray.experimental.internal_kv", "_internal_kv_get", "_internal_kv_del")
_autoscaler = _ray.module(
    "ray.autoscaler._private.constants", "AUTOSCALER_RESOURCE_REQUEST_CHANNEL"
)
_KUBERAY = "ray.autoscaler._private.kuberay.autoscaling_config"
_ray.defined(_KUBERAY, "_get_ray_resources_from_group_spec")
# `__ray_call__`, which Ray adds to every actor class it makes.
_actor = _ray.module("ray.actor", "_modify_class", "ActorClass._remote")
_ray.attribute(_actor._modify_class(type("Probe", (), {})), "__ray_call__")
_remote_function = _ray.module("ray.remote_function", "RemoteFunction._remote")
_ray.defined("ray.actor", ".__ray_metadata__", "_ActorClassMetadata.class_name")
_ray.defined("ray.remote_function", "._function_name")
_raylet = _ray.module(
    "ray._raylet",
    "GcsClient",
    "InnerGcsClient.get_draining_nodes",
    "InnerGcsClient.drain_node",
    "InnerGcsClient.internal_kv_del",
    "InnerGcsClient.internal_kv_exists",
)
_PREEMPTION = _ray.attribute("ray.core.generated.autoscaler_pb2", "DrainNodeReason").Value(
    "DRAIN_NODE_REASON_PREEMPTION"
)
_py_modules = _ray.module("ray._private.runtime_env.py_modules", "upload_py_modules_if_needed")
_working_dir = _ray.module("ray._private.runtime_env.working_dir", "upload_working_dir_if_needed")
_env_constants = _ray.module("ray._private.runtime_env.constants", "RAY_JOB_CONFIG_JSON_ENV_VAR")
_common = _ray.module("ray._common.constants", "HEAD_NODE_RESOURCE_NAME")

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


def start_node(**params: Any) -> Any:
    """Start a Ray node that joins the cluster at `params["gcs_address"]` (Ray's node
    parameters), as `ray.cluster_utils.Cluster.add_node` starts one, but left running
    when this process exits; the node, for `node_pids`."""
    return _node.Node(
        _parameter.RayParams(**params), head=False, shutdown_at_exit=False, spawn_reaper=False
    )


def session_dir() -> str:
    """The session folder (logs, sockets, runtime resources) of the Ray node this
    process started (`ray.init()`'s local cluster)."""
    return _worker._global_node.get_session_dir_path()


def gcs_server_pid() -> int:
    """The pid of the GCS server of the Ray cluster this process started."""
    return _worker._global_node.all_processes["gcs_server"][0].process.pid


def gcs_actor_records() -> bytes:
    """Everything the GCS keeps about the cluster's actors (creation tasks included),
    as it keeps it and as Ray lists it: bytes to search."""
    table = b"".join(_state.state._connect_and_get_accessor().get_actor_table(None, None))
    return table + json.dumps(_state.actors(), default=str).encode()


def requested_resources() -> list[dict[str, float]]:
    """The bundles the autoscaler is asked to keep room for
    (`ray.autoscaler.sdk.request_resources`), as the GCS holds them."""
    raw = _kv._internal_kv_get(_autoscaler.AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else []


def prometheus_discovery_file() -> str:
    """The name of the file in Ray's temp folder (/tmp/ray) that lists every node's
    metrics endpoint for Prometheus's file-based service discovery."""
    return _constants.PROMETHEUS_SERVICE_DISCOVERY_FILE


def kuberay_group_resources(group: dict[str, Any], is_head: bool) -> dict[str, int]:
    """What the KubeRay autoscaler believes a pod of RayCluster group `group` offers, as
    its own parser reads it (rayStartParams, then the container's limits)."""
    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _get_ray_resources_from_group_spec,
    )

    return _get_ray_resources_from_group_spec(group, is_head)


# --- actors --------------------------------------------------------------------------------


def call_on_actor(actor: Any, fn: Any, *args: Any, concurrency_group: str | None = None) -> Any:
    """Run `fn(instance, *args)` inside `actor`'s process, on its instance (Ray's
    `__ray_call__`), in `concurrency_group` when given; the call's ObjectRef."""
    method = actor.__ray_call__
    if concurrency_group is not None:
        method = method.options(concurrency_group=concurrency_group)
    return method.remote(fn, *args)


def start_points() -> dict[str, tuple[Any, str]]:
    """The methods that every start of a Ray actor ("actor") and of a Ray task ("task")
    goes through, as (class, method name): where a guard that refuses them (a tier of
    tests that must start none) wraps them. Their first argument is the actor class or
    remote function (`remote_name`)."""
    return {
        "actor": (_actor.ActorClass, "_remote"),
        "task": (_remote_function.RemoteFunction, "_remote"),
    }


def head_node_resource() -> str:
    """The resource only the head node offers (`node:__internal_head__` in Ray 2.60): a
    bundle that asks for a sliver of it is placed on the head."""
    return str(_common.HEAD_NODE_RESOURCE_NAME)


def remote_name(remote: Any) -> str:
    """What a Ray actor class or remote function is, for a message."""
    if isinstance(remote, _remote_function.RemoteFunction):
        return str(remote._function_name)
    metadata = getattr(remote, "__ray_metadata__", None)
    return str(getattr(metadata, "class_name", None) or repr(remote))


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


def job_driver_environment(runtime_env: dict) -> dict[str, str]:
    """The environment variable through which Ray's job supervisor hands a submitted
    job's driver its `runtime_env` (which `ray.init` then gives every process of the
    job), as a dict to add to an environment."""
    config = {"runtime_env": runtime_env, "metadata": {}}
    return {_env_constants.RAY_JOB_CONFIG_JSON_ENV_VAR: json.dumps(config)}


def drop_job_py_module(folder: str) -> str | None:
    """Take the py_module that Ray unpacked on this node into a folder named `folder`
    out of the runtime_env this submitted job's driver connects with (`ray.init` reads
    it from `job_driver_environment`'s variable), so that no process of the job gets
    it; its URI (gcs://...zip), or None where this driver was handed no such module.
    Call it before `ray.init`."""
    name = _env_constants.RAY_JOB_CONFIG_JSON_ENV_VAR
    config = json.loads(os.environ.get(name) or "{}")
    env = config.get("runtime_env") or {}
    modules = env.get("py_modules") or []
    # Ray unpacks gcs://<name>.zip into <runtime resources>/py_modules_files/<name>.
    found = [u for u in modules if isinstance(u, str) and Path(u).name == f"{folder}.zip"]
    if not found:
        return None
    env["py_modules"] = [u for u in modules if u not in found]
    if not env["py_modules"]:
        del env["py_modules"]
    os.environ[name] = json.dumps(config)
    return found[0]


def delete_package(uri: str, address: str | None = None) -> bool:
    """Delete the package at `uri` (gcs://...: a runtime_env upload) from the GCS at
    `address` (None: this process's connection); whether it was there."""
    return bool(gcs_client(address).internal_kv_del(uri.encode(), False, None))


def package_stored(uri: str, address: str | None = None) -> bool:
    """Whether the GCS at `address` (None: this process's connection) still holds the
    package at `uri` (gcs://...)."""
    return bool(gcs_client(address).internal_kv_exists(uri.encode(), None))


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
