"""Observability on a real job: Ray's metrics endpoint, `spotline status` and `report`.

One tiny pipeline job runs while the test scrapes the Prometheus endpoint of this
node's Ray metrics agent, as Prometheus would; then status and report read the
finished job from its checkpoint URI.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest

import spotline
from conftest import tiny_spec
from spotline.config.loader import SpecError
from spotline.metrics.prometheus import exported_name

pytestmark = pytest.mark.ray

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{.*\})?\s+(?P<value>\S+)")


def scrape() -> dict[str, list[tuple[str, float]]]:
    import ray

    port = ray.nodes()[0]["MetricsExportPort"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, list[tuple[str, float]]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and "spotline" in m["name"]:
            out.setdefault(m["name"], []).append((m["labels"] or "", float(m["value"])))
    return out


def _value(series, name, **labels) -> float | None:
    for lab, v in series.get(exported_name(name), []):
        if 'job="observed"' in lab and all(f'{k}="{x}"' in lab for k, x in labels.items()):
            return v
    return None


@pytest.fixture(scope="module")
def observed(ray_session, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("observed")
    spec = tiny_spec(
        tmp,
        "observed",
        **{
            "train.steps": 80,
            "metrics": {"spot_usd_per_device_hour": 1.5, "on_demand_usd_per_device_hour": 4.0},
        },
    )
    run = spotline.Job(spec).start()
    seen: dict = {}
    live_status = None
    deadline = time.monotonic() + 300
    want = {"spotline_step", "spotline_tokens_per_second", "spotline_bubble_fraction"}
    while time.monotonic() < deadline:
        st = run.status()
        if st["state"] in ("finished", "failed"):
            break
        series = scrape()
        every_rank = all(
            _value(series, "spotline_bubble_fraction", stage=s, replica=r) is not None
            for s in (0, 1)
            for r in (0, 1)
        )  # each rank publishes its own, on its own clock
        if (
            all(exported_name(n) in series for n in want)
            and _value(series, "spotline_step")
            and every_rank
        ):
            seen = series
            from spotline.locate import summary_source as _summary_source

            live_status = _summary_source("observed", "auto")()
            break
        time.sleep(1.0)
    # Another job given the same checkpoint.uri while this one runs is refused before
    # it starts anything, naming this one.
    intruder = tiny_spec(tmp, "intruder", **{"checkpoint.uri": spec.resolved_checkpoint_uri()})
    try:
        spotline.Job(intruder).start()
        refused = None
    except SpecError as e:
        refused = str(e)
    result = run.wait(verbose=False)
    return spec, result, seen, live_status, refused


def test_a_second_job_on_the_running_jobs_checkpoint_uri_is_refused(observed):
    spec, result, *_, refused = observed
    assert refused is not None, "a second job started on the running job's checkpoint.uri"
    assert "in use by job 'observed'" in refused and "Nothing was written there" in refused
    assert result.state == "finished"


def test_metrics_endpoint_carries_the_jobs_series(observed):
    spec, result, series, *_ = observed
    assert series, "no spotline series appeared on Ray's metrics endpoint while the job ran"
    assert _value(series, "spotline_step") > 0
    assert _value(series, "spotline_tokens_per_second") > 0
    assert _value(series, "spotline_step_seconds") > 0
    assert _value(series, "spotline_replicas") == 2
    assert _value(series, "spotline_replicas_max") == 2
    loss = _value(series, "spotline_train_loss")
    assert loss is not None and 0 < loss < 10
    for stage in (0, 1):
        for replica in (0, 1):
            frac = _value(series, "spotline_bubble_fraction", stage=stage, replica=replica)
            assert frac is not None and 0 <= frac < 1
    theory = _value(series, "spotline_bubble_theory")
    assert theory == pytest.approx(1 / 3)
    mfu = _value(series, "spotline_mfu")
    assert mfu is not None and 0 < mfu < 1  # CPU: against the measured matmul peak
    assert _value(series, "spotline_goodput_fraction") is not None
    # No NVIDIA GPU here: the device series are simply absent.
    assert not any("gpu" in name for name in series)


def test_status_table_of_the_running_and_the_finished_job(observed, capsys):
    from spotline.cli import main
    from spotline.report import status_rows

    spec, result, _, live, _ = observed
    assert live is not None and live["state"] in ("running", "checkpointing")
    assert live["step"] > 0 and live["replicas"] == 2
    assert main(["status", result.checkpoint_uri]) == 0
    out = capsys.readouterr().out
    for field in (
        "state",
        "replicas",
        "step",
        "train loss",
        "tokens/s",
        "MFU",
        "bubble",
        "backfill fill",
        "last checkpoint",
        "preemptions",
        "goodput",
    ):
        assert field in out
    assert "finished" in out and "80 / 80" in out and "0 of 2" in out  # nothing runs now
    assert main(["status", result.checkpoint_uri, "--json", "-"]) == 0
    summary = json.loads(capsys.readouterr().out)
    rows = dict(status_rows(summary))
    assert rows["last checkpoint"].startswith("step 80")
    assert "on spot" in rows["goodput"] and "on-demand" in rows["goodput"]


def test_report_writes_non_empty_pngs(observed, tmp_path):
    from spotline.cli import main

    _, result, *_ = observed
    out = tmp_path / "report"
    assert main(["report", result.checkpoint_uri, "--out", str(out)]) == 0
    import matplotlib.image as mpimg

    names = sorted(p.name for p in out.glob("*.png"))
    assert names == ["bubbles.png", "device_time.png", "loss.png", "step_time.png"]
    for p in out.glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        img = mpimg.imread(p)
        assert img.shape[0] > 100 and img.shape[1] > 100
        assert img.std() > 0  # not a blank canvas


def test_result_carries_the_ledger_and_cost(observed):
    _, result, *_ = observed
    parts = result.ledger["device_s"]
    assert sum(parts.values()) == pytest.approx(result.ledger["total_s"], rel=1e-6)
    assert parts["useful"] > 0 and parts["bubble_unfilled"] > 0
    hours = result.ledger["total_s"] / 3600
    assert result.cost["spot"] == pytest.approx(hours * 1.5)
    assert 0 < result.cost["on_demand_same_steps"] <= hours * 4.0
