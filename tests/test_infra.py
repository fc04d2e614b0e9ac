"""The deployment files in infra/ against the real schemas and the job spec."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from spotline.config import load_spec

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
INFRA = REPO / "infra"
SPOT_CONFIG = REPO / "configs" / "llama-1b-spot.yaml"


def _ray_schema() -> dict[str, Any]:
    import ray

    return json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())


@pytest.fixture(scope="module")
def launcher() -> dict[str, Any]:
    return yaml.safe_load((INFRA / "aws" / "spot-cluster.yaml").read_text())


@pytest.fixture(scope="module")
def kuberay() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((INFRA / "kuberay").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


# --- the Ray cluster launcher -------------------------------------------------------------


def test_launcher_config_validates_against_rays_schema(launcher: dict[str, Any]) -> None:
    import jsonschema

    jsonschema.validate(launcher, _ray_schema())


def test_launcher_schema_check_catches_a_bad_file(launcher: dict[str, Any]) -> None:
    import jsonschema

    broken = dict(launcher, max_workers="eight")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, _ray_schema())


def test_launcher_head_is_on_demand_and_workers_are_spot(launcher: dict[str, Any]) -> None:
    types = launcher["available_node_types"]
    head = types[launcher["head_node_type"]]
    assert "InstanceMarketOptions" not in head["node_config"]
    assert head["resources"].get("GPU", 0) == 0
    workers = {k: v for k, v in types.items() if k != launcher["head_node_type"]}
    assert workers
    for name, t in workers.items():
        assert t["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot", name
        assert t["max_workers"] > 0 and 0 <= t["min_workers"] <= t["max_workers"], name
        # IMDSv2, which the 'aws' notice source speaks.
        assert t["node_config"]["MetadataOptions"]["HttpTokens"] == "required", name


def _launcher_workers(launcher: dict[str, Any]) -> dict[str, dict[str, Any]]:
    types = launcher["available_node_types"]
    return {k: v for k, v in types.items() if k != launcher["head_node_type"]}


def test_launcher_gpu_spot_pool_scales_from_zero_on_demand(launcher: dict[str, Any]) -> None:
    # A spot pool with a standing minimum pays for idle GPUs and, after a reclaim, waits
    # for that minimum rather than for the job: the job's request is what brings nodes.
    assert launcher["idle_timeout_minutes"] > 0
    for name, t in _launcher_workers(launcher).items():
        assert t["min_workers"] == 0 and t["max_workers"] > 0, name
        # Declared, so the autoscaler can match the job's bundles before a node exists.
        assert t["resources"].get("GPU", 0) > 0 and t["resources"].get("CPU", 0) > 0, name


def test_launcher_head_takes_no_gpu_work(launcher: dict[str, Any]) -> None:
    head = launcher["available_node_types"][launcher["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    assert "--num-gpus=0" in " ".join(launcher["head_start_ray_commands"])


def test_launcher_dashboard_binds_to_localhost(launcher: dict[str, Any]) -> None:
    head_cmds = " ".join(launcher["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_cmds
    assert "0.0.0.0" not in yaml.safe_dump(launcher)


def test_launcher_installs_spotline(launcher: dict[str, Any]) -> None:
    setup = " ".join(launcher["setup_commands"])
    assert "pip install -e" in setup and "spotline" in setup
    assert _pins()["torch"] in setup


# --- KubeRay --------------------------------------------------------------------------------


def test_kuberay_manifests_are_rayclusters_of_ray_io_v1(kuberay: list[dict[str, Any]]) -> None:
    assert kuberay
    for doc in kuberay:
        assert doc["apiVersion"] == "ray.io/v1"
        assert doc["kind"] in ("RayCluster", "RayJob")


def _cluster_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]


def test_kuberay_head_and_gpu_spot_workers(kuberay: list[dict[str, Any]]) -> None:
    for doc in kuberay:
        spec = _cluster_spec(doc)
        head = spec["headGroupSpec"]
        assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
        head_pod = head["template"]["spec"]
        assert "SPOT" not in json.dumps(head_pod.get("nodeSelector", {})).upper()
        groups = spec["workerGroupSpecs"]
        assert groups
        for g in groups:
            assert 0 <= g["minReplicas"] <= g["maxReplicas"]
            pod = g["template"]["spec"]
            assert "SPOT" in json.dumps(pod["nodeSelector"]).upper()
            for c in pod["containers"]:
                assert int(c["resources"]["limits"]["nvidia.com/gpu"]) > 0


def _group_resources(group: dict[str, Any], is_head: bool) -> dict[str, int]:
    """What the KubeRay autoscaler believes a pod of `group` offers, read by Ray's own
    parser of the RayCluster (rayStartParams, then the container's limits)."""
    from spotline.compat.ray import kuberay_group_resources

    return kuberay_group_resources(group, is_head)


def test_kuberay_gpu_spot_group_scales_from_zero_on_demand(
    kuberay: list[dict[str, Any]],
) -> None:
    for doc in kuberay:
        spec = _cluster_spec(doc)
        # Without the in-tree autoscaler nothing acts on the job's request.
        assert spec["enableInTreeAutoscaling"] is True
        assert spec["autoscalerOptions"]["idleTimeoutSeconds"] > 0
        for g in spec["workerGroupSpecs"]:
            assert g["minReplicas"] == 0 and g["maxReplicas"] > 0, g["groupName"]
            assert g.get("replicas", 0) == 0, g["groupName"]
            res = _group_resources(g, is_head=False)
            limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
            assert res["GPU"] == int(limits["nvidia.com/gpu"]) > 0, g["groupName"]
            # Declared in rayStartParams, as the Ray node inside the pod will have them.
            assert int(g["rayStartParams"]["num-gpus"]) == res["GPU"], g["groupName"]


def test_kuberay_head_takes_no_gpu_work(kuberay: list[dict[str, Any]]) -> None:
    for doc in kuberay:
        head = _cluster_spec(doc)["headGroupSpec"]
        assert _group_resources(head, is_head=True).get("GPU", 0) == 0
        for c in head["template"]["spec"]["containers"]:
            assert "nvidia.com/gpu" not in json.dumps(c.get("resources", {}))


def test_kuberay_grace_period_covers_the_jit_checkpoint_budget(
    kuberay: list[dict[str, Any]],
) -> None:
    spec = load_spec(SPOT_CONFIG)
    budget = spec.preemption.jit_checkpoint_budget_s
    assert "sigterm" in {s.kind for s in spec.preemption.sources}
    for doc in kuberay:
        for g in _cluster_spec(doc)["workerGroupSpecs"]:
            pod = g["template"]["spec"]
            assert pod["terminationGracePeriodSeconds"] >= budget
            env = {e["name"]: e for c in pod["containers"] for e in c.get("env", [])}
            drain = float(env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"]["value"])
            assert budget <= drain <= pod["terminationGracePeriodSeconds"]


def test_ray_job_stop_leaves_the_driver_time_to_stop_the_job_with_a_commit(
    kuberay: list[dict[str, Any]],
) -> None:
    from spotline import constants

    for doc in kuberay:
        pod = _cluster_spec(doc)["headGroupSpec"]["template"]["spec"]
        env = {e["name"]: e for c in pod["containers"] for e in c.get("env", [])}
        wait = float(env["RAY_JOB_STOP_WAIT_TIME_S"]["value"])
        assert wait > constants.SPOTLINE_DRIVER_STOP_GRACE_S


def _env_entries(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        found = list(node["env"]) if isinstance(node.get("env"), list) else []
        return found + [e for v in node.values() for e in _env_entries(v)]
    if isinstance(node, list):
        return [e for v in node for e in _env_entries(v)]
    return []


def test_kuberay_credentials_come_only_from_secrets(kuberay: list[dict[str, Any]]) -> None:
    for doc in kuberay:
        assert doc["kind"] != "Secret", "credentials must not be committed as a Secret"
        entries = _env_entries(doc)
        creds = [e for e in entries if re.search(r"KEY|SECRET|TOKEN|PASSWORD", e["name"])]
        assert creds, "the pods need object-storage credentials"
        for e in creds:
            assert "value" not in e, f"{e['name']} is set inline"
            assert "secretKeyRef" in e["valueFrom"], e["name"]


# --- the image and the configs ---------------------------------------------------------------


def _pins() -> dict[str, str]:
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    out = {}
    for d in deps:
        m = re.match(r"^([A-Za-z0-9_.-]+)(\[[^\]]*\])?==(\S+)$", d)
        if m:
            out[m.group(1)] = f"{m.group(1)}=={m.group(3)}"
    return out


def test_dockerfile_uses_a_cuda_base_and_the_same_pins() -> None:
    text = (INFRA / "Dockerfile").read_text()
    assert re.search(r"^FROM nvidia/cuda:\S+", text, re.M)
    pins = _pins()
    assert pins["torch"] in text  # the CUDA build of exactly the pinned torch
    # Everything else comes from pyproject itself, so the pins cannot drift.
    assert 'pip install -e ".[s3,gpu]"' in text
    for name in ("deepspeed", "ray", "fsspec"):
        assert f"{name}==" not in text or pins[name] in text


def test_infra_refers_to_configs_that_exist() -> None:
    texts = [p.read_text() for p in INFRA.rglob("*") if p.is_file()]
    referenced = {m for t in texts for m in re.findall(r"configs/[\w.-]+\.yaml", t)}
    assert "configs/llama-1b-spot.yaml" in referenced
    for rel in referenced:
        assert (REPO / rel).is_file(), rel


def test_spot_config_is_sized_for_the_infra(
    launcher: dict[str, Any], kuberay: list[dict[str, Any]]
) -> None:
    from spotline.runtime.cluster import replicas_fit
    from spotline.runtime.placement import worker_bundle

    spec = load_spec(SPOT_CONFIG)
    # 'gpu': on a pool that starts with no GPU node, the job asks for GPU bundles and
    # waits for them; 'auto' would ask for CPU bundles until a GPU node is up.
    assert spec.resources.device == "gpu"
    assert spec.checkpoint.uri.startswith("s3://")
    assert {"aws", "ray-drain", "sigterm"} <= {s.kind for s in spec.preemption.sources}
    replica = [worker_bundle(spec, "gpu", s) for s in range(spec.parallel.pipeline_stages)]
    # max_replicas is exactly what the pool holds at its maximum, counted the way the
    # controller counts capacity: the whole bundle (GPU and CPU) against each node.
    pools = [(t["max_workers"], t["resources"]) for t in _launcher_workers(launcher).values()]
    for doc in kuberay:
        for g in _cluster_spec(doc)["workerGroupSpecs"]:
            pools.append((g["maxReplicas"], _group_resources(g, is_head=False)))
    assert pools
    for nodes, res in pools:
        per_node = replicas_fit(replica, [dict(res)])
        assert per_node * spec.parallel.pipeline_stages == res["GPU"], res
        assert nodes * per_node == spec.elastic.max_replicas, res


# --- Grafana and Prometheus -------------------------------------------------------------


def test_grafana_dashboard_references_only_exported_series() -> None:
    from spotline.metrics.prometheus import METRICS, exported_name

    dash = json.loads((INFRA / "grafana" / "spotline.json").read_text())
    exported = {exported_name(m.name) for m in METRICS}
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    used = {name for e in exprs for name in re.findall(r"\bray_spotline_[a-z_]+\b", e)}
    assert used, "the dashboard queries no Spotline series"
    assert used <= exported, f"not exported by Spotline: {sorted(used - exported)}"
    assert exported <= used, f"exported but on no panel: {sorted(exported - used)}"
    # Every other identifier in a query is PromQL, not a metric name.
    for e in exprs:
        other = set(re.findall(r"\b(ray_[a-z_]+)\b", e)) - exported
        assert not other, f"{e!r} queries unknown series {other}"
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


def test_prometheus_scrapes_rays_service_discovery_file() -> None:
    from spotline.compat.ray import prometheus_discovery_file

    cfg = yaml.safe_load((INFRA / "prometheus" / "prometheus.yml").read_text())
    (job,) = cfg["scrape_configs"]
    files = [f for sd in job["file_sd_configs"] for f in sd["files"]]
    assert files == [f"/tmp/ray/{prometheus_discovery_file()}"]


def test_every_series_is_declared_once() -> None:
    from spotline.metrics.prometheus import METRICS

    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    assert all(n.startswith("spotline_") for n in names)
    assert all(m.kind == "gauge" or m.name.endswith("_total") for m in METRICS)
