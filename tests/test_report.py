"""`spotline status` rows and `spotline report` PNGs from a summary (no Ray)."""

from __future__ import annotations

import pytest

from spotline.bubbles import simulate
from spotline.bubbles.trace import chrome_trace
from spotline.metrics.ledger import GoodputLedger
from spotline.report import (
    loss_figure,
    status_rows,
    step_time_figure,
    timeline_figure,
    write_report,
)

pytestmark = pytest.mark.unit


def _summary() -> dict:
    led = GoodputLedger()
    led.train(100.0, devices=4, steps=100, bubble_fraction=0.2, fill_fraction=0.5)
    led.charge("recovery", 10.0, devices=4)
    return {
        "name": "job",
        "state": "waiting",
        "waiting": "0 replicas fit; min_replicas is 1.",
        "step": 100,
        "total_steps": 300,
        "replicas": 0,
        "max_replicas": 2,
        "train_loss": 2.5,
        "heldout_loss": None,
        "eval": {"step": 100, "loss": 2.6},
        "evals": [{"step": 50, "loss": 3.0}, {"step": 100, "loss": 2.6}],
        "tokens_per_s": 1234.0,
        "mfu": 0.41,
        "bubbles": {"bubble_fraction": 0.21, "theory": 0.2, "fill_fraction": 0.5},
        "last_checkpoint": {"step": 100, "uri": "file:///x/step_00000100"},
        "preemption_notices": 1,
        "node_losses": 1,
        "restarts": 2,
        "ledger": {**led.to_dict(), "goodput": led.goodput()},
        "cost": led.cost(1.0, 3.0),
        "history": [{"step": s, "step_s": 0.1 + 0.01 * (s > 60)} for s in range(10, 101, 10)],
        "losses": {str(s): 5.0 - s / 40 for s in range(1, 101)},
        "notices": [{"source": "aws", "committed_step": 60}],
        "resizes": [{"step": 60, "from_replicas": 2, "why": "preemption"}],
        "peer_memory": {
            "every_steps": 25,
            "chosen": "measured",
            "cost_s": 0.04,
            "share_of_training": 0.016,
            "newest_step": 100,
            "restores": [{"step": 75, "bytes": 10, "from": "ab12"}],
        },
        "error": None,
    }


def test_status_rows_name_every_field():
    rows = dict(status_rows(_summary()))
    assert rows["waiting"].startswith("0 replicas fit")
    assert rows["step"] == "100 / 300" and rows["replicas"] == "0 of 2"
    assert rows["eval loss"] == "2.6000 (weights of step 100)"
    assert rows["MFU"] == "41.0%" and rows["tokens/s"] == "1,234"
    assert rows["bubble"] == "21.0% measured, 20.0% theory"
    assert rows["backfill fill"] == "50.0%"
    assert rows["preemptions"] == "1 notice(s), 1 node(s) lost, 2 restart(s)"
    assert rows["goodput"].startswith("72.7%") and "on spot" in rows["goodput"]
    assert rows["peer memory"] == (
        "every 25 step(s) (measured), 40 ms each, 1.6% of training; newest step 100; "
        "1 restore(s) from it"
    )
    assert dict(status_rows({**_summary(), "peer_memory": None}))["peer memory"] == "off"


def _trace() -> dict:
    tls = simulate(2, 4, t_fwd=0.01, t_bwd=0.02)
    return chrome_trace(
        [
            {
                "stage": s,
                "replica": 0,
                "rank": s,
                "steps_timeline": [
                    {
                        "step": 9,
                        "start_ns": 0,
                        "instrs": [(i.name, i.slot, i.start, i.end) for i in tl],
                    }
                ],
                "slices": [(1_000_000, 3_000_000, "eval")],
            }
            for s, tl in enumerate(tls)
        ]
    )


def test_report_writes_each_plot(tmp_path):
    paths = write_report(_summary(), _trace(), tmp_path)
    assert sorted(p.name for p in paths) == [
        "bubbles.png",
        "device_time.png",
        "loss.png",
        "step_time.png",
    ]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_each_legend_entry_has_the_color_of_its_bars():
    from matplotlib.colors import to_rgba

    fig = timeline_figure(_trace())
    (legend,) = fig.legends
    legend_color = {
        t.get_text(): to_rgba(h.get_facecolor())
        for t, h in zip(legend.get_texts(), legend.legend_handles, strict=True)
    }
    bars = [c for c in fig.axes[0].collections if c.get_gid()]
    assert {c.get_gid() for c in bars} == set(legend_color) >= {"compute", "idle", "backfill"}
    for c in bars:
        assert tuple(c.get_facecolor()[0]) == legend_color[c.get_gid()], c.get_gid()
    assert len(set(legend_color.values())) == len(legend_color)  # one color per kind


@pytest.mark.parametrize(
    "figure",
    [
        lambda: loss_figure(_summary() | {"batch": {"history": [[1, 16]]}}),
        lambda: step_time_figure(_summary()),
        lambda: timeline_figure(_trace()),
    ],
    ids=["loss", "step_time", "bubbles"],
)
def test_legends_cover_nothing_drawn(figure):
    """The legend lies outside every axes: it hides no line or bar (the global batch's
    flat dashed line ran through it at the top of the loss plot)."""
    fig = figure()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    assert fig.legends and not any(ax.get_legend() for ax in fig.axes)
    for legend in fig.legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent(renderer)), ax


def test_watching_a_job_that_ends_shows_how_it_ended(tmp_path):
    """The job's driver stops the controller once the job is done; the watch then shows
    the summary stored beside the checkpoints instead of failing on the gone actor."""
    import io
    import json

    from ray.exceptions import ActorDiedError
    from rich.console import Console

    from spotline.checkpoint import SUMMARY_ARTIFACT, CheckpointStore
    from spotline.report import print_status

    uri = f"file://{tmp_path}/ckpt"
    running = _summary() | {"state": "running", "waiting": None, "checkpoint_uri": uri}
    final = running | {"state": "finished", "step": 300}
    CheckpointStore(uri).write_artifact(SUMMARY_ARTIFACT, json.dumps(final).encode())
    answers = iter([running])

    def fetch():
        for s in answers:
            return s
        raise ActorDiedError()

    out = io.StringIO()
    print_status(fetch, watch=0.01, console=Console(file=out, width=120))
    assert "finished" in out.getvalue() and "300 / 300" in out.getvalue()


def test_the_goodput_chart_speaks_in_human_units_and_names():
    from spotline.report import PART_NAMES, device_time_figure

    s = _summary()
    s["ledger"]["device_s"] = {**s["ledger"]["device_s"], "startup_other": 900.0}
    fig = device_time_figure(s)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert "useful compute" in labels and "start-up and other" in labels
    assert not any("_" in label for label in labels)
    assert ax.get_ylabel() == "device-minutes"
    assert "start-up is" in ax.get_title() and "short run" in ax.get_title()
    texts = " ".join(t.get_text() for t in ax.texts)
    assert "e-0" not in texts and "%" in texts
    assert set(PART_NAMES) >= {"useful", "bubble_unfilled", "startup_other"}


def test_the_step_time_chart_names_what_made_steps_slow():
    from spotline.report import spike_causes, step_marks

    s = _summary() | {
        "committed_steps": [50, 100],
        "history": [
            {"step": 40, "step_s": 0.1},
            {"step": 50, "step_s": 0.4},  # a save in it
            {"step": 60, "step_s": 0.1},
            {"step": 55, "step_s": 0.1},  # a group resumed from an earlier step
            {"step": 70, "step_s": 0.1},
            {"step": 80, "step_s": 0.5},  # nothing known: left unlabelled
            {"step": 90, "step_s": 0.1},
        ],
        "peer_memory": {"every_steps": 30, "chosen": "fixed"},
    }
    marks = step_marks(s)
    assert ("save", 50) in marks and ("notice", 60) in marks and ("restart", 55) in marks
    assert ("peer copy", 30) in marks and ("peer copy", 90) in marks
    assert spike_causes(s["history"], marks) == {(50, 0.4): "save"}
    fig = step_time_figure(s)
    assert len(fig.axes[0].lines) >= 2  # the history drawn in pieces, not back in time
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert {"checkpoint save", "restart / resize", "peer copy (every 30 steps)"} <= set(labels)


def test_a_trace_is_cut_to_a_range_of_steps():
    from spotline.bubbles.trace import cut_steps

    trace = chrome_trace(
        [
            {
                "stage": 0,
                "replica": 0,
                "rank": 0,
                "steps_timeline": [
                    {"step": k, "start_ns": k * 10**8, "instrs": [("ForwardPass", 0, 0.0, 0.01)]}
                    for k in range(5, 10)
                ],
            }
        ]
    )
    cut = cut_steps(trace, 6, 7)
    steps = {e["args"]["step"] for e in cut["traceEvents"] if e.get("ph") == "X"}
    assert steps == {6, 7} and cut["otherData"]["steps"] == [6, 7]
    with pytest.raises(ValueError, match="holds steps 5-9"):
        cut_steps(trace, 20, 30)


def test_the_book_keeps_the_steps_of_earlier_polls_for_the_trace():
    from spotline.bubbles.book import TRACE_STEPS, BubbleBook

    book = BubbleBook(2)
    for first in range(1, 60, 4):
        steps = [{"step": k, "start_ns": k, "instrs": []} for k in range(first, first + 4)]
        book.add([{"stage": 0, "replica": 0, "rank": 0, "steps_timeline": steps}], 4)
    kept = [s["step"] for s in book.latest[0]["steps_timeline"]]
    assert kept == list(range(61 - TRACE_STEPS, 61))
