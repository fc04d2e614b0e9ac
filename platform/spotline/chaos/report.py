"""A rehearsal's report directory: the verdict as Markdown, the event log, the timeline
PNG, every figure as JSON, and the charts `spotline report` draws for the rehearsed job.

`spotline report DIR` draws them again from chaos.json (`is_chaos_report`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from spotline.chaos.cluster import node_death_note

FIGURES = "chaos.json"
VERDICT = "verdict.md"
EVENTS = "events.log"
TIMELINE = "timeline.png"
SUMMARY = "summary.json"

_COLORS = {"notice": "tab:orange", "loss": "tab:red", "gone": "tab:red", "join": "tab:green"}


def is_chaos_report(path: str | Path) -> bool:
    return (Path(path) / FIGURES).is_file()


def write_chaos_report(figures: dict[str, Any], out: Path) -> list[Path]:
    """Every file of the report directory `out`; their paths."""
    import matplotlib

    matplotlib.use("Agg")
    from spotline.report import write_report

    out.mkdir(parents=True, exist_ok=True)
    written = []
    path = out / FIGURES
    path.write_text(json.dumps(figures, indent=2, default=str) + "\n")
    written.append(path)
    path = out / VERDICT
    path.write_text(render_verdict(figures))
    written.append(path)
    path = out / EVENTS
    path.write_text(event_log(figures))
    written.append(path)
    written.append(_save(timeline_figure(figures), out / TIMELINE))
    summary = figures.get("summary")
    if summary:
        (out / SUMMARY).write_text(json.dumps(summary, indent=2, default=str) + "\n")
        written.append(out / SUMMARY)
        written += write_report(summary, None, out)
    return written


def redraw(out: Path) -> list[Path]:
    """The report directory `out` drawn again from its chaos.json (`spotline report`)."""
    figures = json.loads((out / FIGURES).read_text())
    return write_chaos_report(figures, out)


# --- text ---------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}s"


def render_verdict(f: dict[str, Any]) -> str:
    """The verdict as Markdown: what `spotline chaos` prints and verdict.md holds."""
    trace = f["trace"]
    ref, chaos = f["reference"], f["chaos"]
    lines = [
        f"# {f['verdict']}: {f['job']} under trace {trace['name']}",
        "",
        f"{trace['about']}; {f['nodes']} spot node(s), {trace['duration_s']:g}s from the "
        f"first step.",
        "",
        *[f"- {r}" for r in f["reasons"]],
        "",
        "## Figures",
        "",
        f"- **exact resume**: {_yes(f['exact_resume'])}"
        + (
            f" (first differing step {f['first_differing_step']})"
            if f.get("first_differing_step") is not None
            else f" ({f['compared_steps']} steps compared, {f['identical_steps']} bit for bit)"
        ),
        f"- **committed-step goodput**: {_pct(f['goodput'])} (committed steps per second of "
        "training, "
        f"against the uninterrupted run's: {f['committed_steps']} steps in "
        f"{_s(chaos['to_last_commit_s'])} here, {_s(ref['to_last_commit_s'])} uninterrupted)"
        + (
            "; above 100%: the uninterrupted run was slower, as this machine's load changed "
            "between the runs (goodput is rough on a shared machine)"
            if (f["goodput"] or 0) > 1.02
            else ""
        ),
        f"- **steps lost**: {f['steps_lost']} (trained, then trained again after an event)",
        f"- **run**: {chaos['state']} at step {chaos['steps']}; start-up "
        f"{_s(chaos['first_step_s'])} before the first step (not counted)",
        "",
        "## Events",
        "",
        "| at | event | node | cost |",
        "|---:|---|---:|---|",
    ]
    for e in f["events"]:
        cost = _event_cost(e)
        kind = e["kind"] if e["kind"] != "gone" else "gone (deadline)"
        lines.append(f"| {e['at']:.1f}s | {kind} | {e['node']} | {cost} |")
    if f.get("unreplayed_events"):
        lines.append(f"\n{f['unreplayed_events']} event(s) not replayed: the job had finished.")
    if any(e["kind"] in ("loss", "gone") and e["hit"] for e in f["events"]):
        lines.append(f"\nTimes of a loss: {node_death_note()}.")
    lines.append(
        "\n`device_time.png` is where the job's device time went (useful compute, bubbles, "
        "restarts): its ledger, not the committed-step goodput above."
    )
    lines += ["", "## What the job's settings cost", ""]
    lines += [f"- {s}" for s in f["settings"]] or ["- nothing measurable under this trace"]
    lines += ["", "## Changed to run here", ""]
    lines += [f"- {c}" for c in f["changes"]]
    lines += [f"- footprint: {f['footprint']}", ""]
    return "\n".join(lines)


def _yes(v: bool | None) -> str:
    return {True: "yes", False: "no", None: "not checked"}[v]


def _event_cost(e: dict[str, Any]) -> str:
    if e["kind"] == "join":
        used = e.get("used_after_s")
        return "not used by the job" if used is None else f"used after {used:.1f}s"
    if not e["hit"]:
        return "no rank of the job there"
    parts = []
    if e["kind"] == "notice":
        if e.get("notice_to_commit_s") is not None:
            parts.append(
                f"notice -> commit {e['notice_to_commit_s']:.1f}s of {e['deadline_s']:g}s "
                f"(step {e['committed_step']})"
            )
        else:
            parts.append(e.get("outcome") or "not answered")
    parts.append(f"{e['steps_lost']} step(s) lost")
    if e.get("training_again_s") is not None:
        parts.append(f"training again after {e['training_again_s']:.1f}s")
    return "; ".join(parts)


def event_log(f: dict[str, Any]) -> str:
    """The rehearsal's event log: the trace's events as they landed and the job's own
    events, in time order, in seconds from the first step."""
    t0 = f["chaos"].get("t0") or 0.0
    lines = [f"# {f['job']} under trace {f['trace']['name']}; seconds from the first step"]
    for t, line in f.get("log") or []:
        stamp = time.strftime("%H:%M:%S", time.localtime(t))
        lines.append(f"{stamp} {t - t0:8.1f}s  {line}")
    return "\n".join(lines) + "\n"


# --- the timeline PNG ------------------------------------------------------------------------


def timeline_figure(f: dict[str, Any]):
    """Node lanes with the trace's events, the job's replicas, its trained and committed
    steps over time, and its loss against the uninterrupted run's."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    t0 = f["chaos"].get("t0") or 0.0
    log = f.get("node_log") or []
    lanes = sorted({e["node"] for e in log})
    fig = plt.figure(figsize=(11, 10), layout="constrained")
    grid = fig.add_gridspec(4, 1, height_ratios=[0.5 * len(lanes) + 1, 1.2, 2, 2.2])
    ax_nodes = fig.add_subplot(grid[0])
    ax_rep = fig.add_subplot(grid[1], sharex=ax_nodes)
    ax_steps = fig.add_subplot(grid[2], sharex=ax_nodes)
    ax_loss = fig.add_subplot(grid[3])
    samples = f.get("samples") or []
    end = max([s["t"] - t0 for s in samples] + [f["trace"]["duration_s"]])
    start = min([s["t"] - t0 for s in samples] + [0.0])
    ranks_on = {n: [] for n in lanes}
    ids = {e["node"]: e["node_id"] for e in log}
    for s in samples:
        for n in lanes:
            if ids.get(n) in s.get("nodes", ()):
                ranks_on[n].append(s["t"] - t0)
    for row, n in enumerate(lanes):
        up = [e for e in log if e["node"] == n]
        born = next((e["t"] - t0 for e in up if e["kind"] in ("start", "join")), start)
        born = max(born, start)
        died = next((e["t"] - t0 for e in up if e["kind"] in ("loss", "gone")), end)
        noticed = next((e["t"] - t0 for e in up if e["kind"] == "notice"), None)
        ax_nodes.broken_barh([(born, died - born)], (row - 0.35, 0.7), color="lightsteelblue")
        if noticed is not None:
            ax_nodes.broken_barh(
                [(noticed, died - noticed)], (row - 0.35, 0.7), color="navajowhite", hatch="//"
            )
        spans = _spans(ranks_on[n], 2.5 * _poll(samples))
        if spans:
            ax_nodes.broken_barh(spans, (row - 0.12, 0.24), color="tab:blue")
        for e in up:
            if e["kind"] in _COLORS:
                marker = {"notice": "v", "loss": "X", "gone": "x", "join": "^"}[e["kind"]]
                ax_nodes.plot(e["t"] - t0, row, marker, color=_COLORS[e["kind"]], ms=10)
    ax_nodes.set_yticks(range(len(lanes)), [f"spot node {n}" for n in lanes])
    ax_nodes.invert_yaxis()
    ax_nodes.set_title(
        f"{f['job']} under trace {f['trace']['name']}: {f['verdict']} "
        f"(committed-step goodput {_pct(f['goodput'])}, {f['steps_lost']} step(s) lost)"
    )
    handles = [
        Patch(color="lightsteelblue", label="node up"),
        Patch(facecolor="navajowhite", hatch="//", label="noticed, draining"),
        Patch(color="tab:blue", label="the job's ranks on it"),
        Line2D([], [], marker="v", color="tab:orange", ls="", label="notice"),
        Line2D([], [], marker="X", color="tab:red", ls="", label="loss / deadline"),
        Line2D([], [], marker="^", color="tab:green", ls="", label="join"),
    ]
    ax_nodes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    ts = [s["t"] - t0 for s in samples]
    ax_rep.step(ts, [s["replicas"] for s in samples], where="post", color="tab:purple")
    ax_rep.set(ylabel="replicas")
    ax_rep.set_ylim(bottom=0)
    ax_steps.plot(ts, [s["step"] for s in samples], lw=1, label="trained step")
    ax_steps.step(ts, [s["committed"] for s in samples], where="post", label="committed step")
    ax_steps.set(ylabel="step", xlabel="seconds from the first step")
    ax_steps.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    for e in f.get("applied") or []:
        for ax in (ax_rep, ax_steps):
            ax.axvline(e["at"], color=_COLORS.get(e["kind"], "grey"), ls=":", lw=1)
    for ax in (ax_nodes, ax_rep, ax_steps):
        ax.grid(alpha=0.3)
    _loss_panel(ax_loss, f)
    return fig


def _loss_panel(ax, f: dict[str, Any]) -> None:
    upto = f.get("committed_steps") or 0
    ref = sorted(
        (int(k), v) for k, v in (f.get("reference_losses") or {}).items() if int(k) <= upto
    )
    got = sorted((int(k), v) for k, v in (f.get("losses") or {}).items())
    if ref:
        ax.plot(*zip(*ref, strict=True), lw=2.5, color="lightgrey", label="uninterrupted run")
    if got:
        ax.plot(*zip(*got, strict=True), lw=1, color="tab:blue", label="under the trace")
    for a in (f.get("attempts") or [])[1:]:
        if a.get("restored_from") is not None:
            ax.axvline(a["restored_from"], color="tab:orange", ls=":", lw=1)
    first = f.get("first_differing_step")
    if first is not None:
        ax.axvline(first, color="tab:red", lw=1.5, label=f"first differing step ({first})")
    ax.plot([], [], color="tab:orange", ls=":", label="a group resumed from here")
    ax.set(xlabel="step", ylabel="train loss", title="loss, against the uninterrupted run")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _poll(samples: list[dict[str, Any]]) -> float:
    if len(samples) < 2:
        return 1.0
    return (samples[-1]["t"] - samples[0]["t"]) / (len(samples) - 1)


def _spans(times: list[float], gap: float) -> list[tuple[float, float]]:
    """Runs of sample times no more than `gap` apart, as (start, width) bars."""
    out: list[tuple[float, float]] = []
    for t in times:
        if out and t - (out[-1][0] + out[-1][1]) <= gap:
            out[-1] = (out[-1][0], t - out[-1][0])
        else:
            out.append((t, 0.0))
    return [(a, max(w, 0.2)) for a, w in out]
