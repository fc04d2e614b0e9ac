"""A job's figures for people: the `spotline status` table, `spotline report` PNGs (with
the stacks of its hangs), and `spotline stacks` lines.

Both read one summary dict: a running controller's `summary()`, or the copy the
controller keeps beside the checkpoints (`artifacts/summary.json`, rewritten at
every commit and at the end), so they work on a live job and on a finished one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

# --- status -------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _num(x: float | None, fmt: str = "{:.4f}") -> str:
    return "-" if x is None else fmt.format(x)


def status_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, value) rows of the status table, from a summary."""
    b = s.get("bubbles") or {}
    ledger = s.get("ledger") or {}
    cost = s.get("cost") or {}
    last = s.get("last_checkpoint")
    preempt = (
        f"{s.get('preemption_notices', 0)} notice(s), {s.get('node_losses', 0)} node(s) lost, "
        f"{s.get('restarts', 0)} restart(s)"
    )
    goodput = _pct(ledger.get("goodput"))
    if cost.get("spot") is not None:
        goodput += f"  (${cost['spot']:.2f} on spot"
        if cost.get("on_demand_same_steps") is not None:
            goodput += f", ${cost['on_demand_same_steps']:.2f} for the same steps on-demand"
        goodput += ")"
    rows = [
        ("job", str(s.get("name"))),
        ("state", str(s.get("state"))),
        ("replicas", f"{s.get('replicas', 0)} of {s.get('max_replicas', '?')}"),
        ("device", _device(s)),
        ("step", f"{s.get('step', 0)} / {s.get('total_steps', '?')}"),
        ("train loss", _num(s.get("train_loss"))),
        ("global batch", _batch(s)),
        ("eval loss", _eval(s)),
        ("tokens/s", _num(s.get("tokens_per_s"), "{:,.0f}")),
        ("MFU", _pct(s.get("mfu"))),
        ("data stall", _pct(s.get("data_stall_fraction"))),
        (
            "bubble",
            "-"
            if not b
            else f"{_pct(b.get('bubble_fraction'))} measured, {_pct(b.get('theory'))} theory",
        ),
        ("backfill fill", _pct(b.get("fill_fraction")) if b else "-"),
        ("last checkpoint", "-" if last is None else f"step {last['step']}  {last['uri']}"),
        ("peer memory", _peer(s.get("peer_memory"))),
        ("preemptions", preempt),
        ("goodput", goodput),
    ]
    if s.get("waiting"):
        rows.insert(2, ("waiting", str(s["waiting"])))
    if s.get("quarantined_steps"):
        rows.append(
            (
                "quarantined",
                f"steps {s['quarantined_steps']}: failed verification, never restored; "
                "quarantine.json in each step's folder says why",
            )
        )
    rows += health_rows(s.get("health") or {})
    if s.get("error"):
        rows.append(("error", str(s["error"])))
    return rows


def _peer(p: dict[str, Any] | None) -> str:
    """Peer copies: how often, what each costs, the newest, and the restores from them."""
    if not p:
        return "off"
    if not p.get("every_steps"):
        return "measuring the cost of a copy"
    out = f"every {p['every_steps']} step(s) ({p['chosen']})"
    if p.get("cost_s") is not None:
        out += f", {p['cost_s'] * 1e3:.0f} ms each, {_pct(p.get('share_of_training'))} of training"
    if p.get("newest_step") is not None:
        out += f"; newest step {p['newest_step']}"
    if p.get("restores"):
        out += f"; {len(p['restores'])} restore(s) from it"
    return out


def health_rows(h: dict[str, Any]) -> list[tuple[str, str]]:
    """The hang watch, and while a hang builds up (no step for half the bound, or a rank
    silent for 5 s) every rank's heartbeat; the stragglers; the cordoned nodes."""
    rows: list[tuple[str, str]] = []
    quiet, bound = h.get("quiet_s"), h.get("hang_bound_s")
    if quiet is not None and bound:
        rows.append(("hang watch", f"no step for {quiet:.1f}s ({bound:.1f}s allowed)"))
    ranks = h.get("ranks") or []
    building = (quiet is not None and bound and quiet >= bound / 2) or any(
        r["running"] and r["heartbeat_age_s"] >= 5.0 for r in ranks
    )
    if building:
        for r in ranks:
            rows.append(
                (
                    f"rank {r['rank']}",
                    f"stage {r['stage']} replica {r['replica']} node {str(r['node'])[:12]}: "
                    f"step {r['step']}, '{r['phase']}' for {r['phase_s']:.1f}s, heartbeat "
                    f"{r['heartbeat_age_s']:.1f}s ago",
                )
            )
    for st in h.get("stragglers") or []:
        rows.append(
            (
                "straggler",
                f"rank {st['rank']} (stage {st['stage']}, replica {st['replica']}, node "
                f"{str(st['node'])[:12]}): {st['slowdown']:+.0%} compute per step "
                f"({st['compute_s'] * 1e3:.1f} ms vs {st['peers_s'] * 1e3:.1f} ms)",
            )
        )
    stall = h.get("data_stall")
    if stall:
        rows.append(
            (
                "data stall now",
                f"rank(s) {', '.join(map(str, stall['ranks']))} waiting for their batches for "
                f"{stall['waited_s']:.0f}s (a data failure at {stall['limit_s']:.0f}s): "
                "storage, not a hang",
            )
        )
    left = {c["node"]: c.get("expires_in_s") for c in h.get("cordons") or []}
    for node, why in (h.get("cordoned") or {}).items():
        expires = left.get(node)
        until = f" (expires in {expires / 3600:.1f}h)" if expires is not None else ""
        rows.append(("cordoned", f"node {node[:12]}: {why}{until}"))
    if h.get("hangs"):
        rows.append(("hangs", str(len(h["hangs"]))))
    stacks = h.get("stacks") or []
    if stacks:
        rows += stack_rows(stacks[-1])
    return rows


def stack_rows(taken: dict[str, Any]) -> list[tuple[str, str]]:
    """The frame each named rank was in when a hang's stacks were taken, and where the
    whole stacks are."""
    rows = [
        (
            "stacks",
            f"{taken.get('why', 'hang')} at step {taken.get('step')}"
            + (f": {taken['uri']}" if taken.get("uri") else ""),
        )
    ]
    for rank, r in (taken.get("ranks") or {}).items():
        state = f" (process {r['state']})" if r.get("state") else ""
        where = r.get("frame") or f"no stack: {r.get('error')}"
        rows.append((f"rank {rank} stack", f"{where}{state}"))
    return rows


def _device(s: dict[str, Any]) -> str:
    """What the group runs on (the last group's when none is live)."""
    device = s.get("device")
    return {"gpu": "GPU (nccl)", "cpu": "CPU (gloo)", None: "-"}.get(device, str(device))


def _batch(s: dict[str, Any]) -> str:
    b = s.get("batch")
    if not b:
        return "-"
    out = f"{b.get('global_batch_size')} sequences ({b.get('schedule')})"
    if b.get("schedule") == "adaptive":
        noise = b.get("noise_scale")
        out += f", noise scale {'-' if noise is None else f'{noise:,.1f}'}"
        out += f", {max(0, len(b.get('history') or []) - 1)} change(s)"
    return out


def batch_steps(s: dict[str, Any]) -> list[tuple[int, int]]:
    """(step, global batch) points of the schedule, as a step function to the last step."""
    b = s.get("batch") or {}
    hist = [(int(a), int(v)) for a, v in b.get("history") or []]
    if not hist:
        return []
    last = max([int(k) for k in (s.get("losses") or {})] + [hist[-1][0]])
    pts: list[tuple[int, int]] = []
    for (first, size), nxt in zip(hist, [*hist[1:], (last + 1, None)], strict=True):
        pts += [(first, size), (max(first, nxt[0] - 1), size)]
    return pts


def _eval(s: dict[str, Any]) -> str:
    ev = s.get("eval")
    if ev:
        return f"{ev['loss']:.4f} (weights of step {ev['step']})"
    return _num(s.get("heldout_loss"))


def render_status(s: dict[str, Any]):
    from rich.table import Table

    table = Table(title=f"Spotline job {s.get('name')}", show_header=False, title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value")
    for k, v in status_rows(s):
        table.add_row(k, v)
    return table


def print_status(fetch, watch: float | None = None, console=None) -> None:
    """Print the table once, or refresh it every `watch` seconds until Ctrl-C."""
    from rich.console import Console
    from rich.live import Live

    console = console or Console()
    if not watch:
        console.print(render_status(fetch()))
        return
    s = fetch()
    with Live(render_status(s), console=console, refresh_per_second=4) as live:
        try:
            while True:
                time.sleep(watch)
                try:
                    s = fetch()
                except Exception as e:
                    # The job ended between two refreshes and its driver stopped the
                    # controller: what it stored beside the checkpoints is how it ended.
                    s = _final_summary(s, e)
                live.update(render_status(s))
                if s.get("state") in ("finished", "failed", "stopped"):
                    return
        except KeyboardInterrupt:
            return


def _final_summary(last: dict[str, Any], error: Exception) -> dict[str, Any]:
    """The summary a job whose controller is gone stored at its end; `error` again when
    the controller did not go (or nothing was stored)."""
    from ray.exceptions import RayActorError

    from spotline.checkpoint import SUMMARY_ARTIFACT, CheckpointStore

    if not isinstance(error, RayActorError) or not last.get("checkpoint_uri"):
        raise error
    stored = load_json(CheckpointStore(last["checkpoint_uri"]).read_artifact(SUMMARY_ARTIFACT))
    if stored is None:
        raise error
    return stored


# --- report -------------------------------------------------------------------------


def write_report(s: dict[str, Any], trace: dict[str, Any] | None, out: Path) -> list[Path]:
    """The report's PNGs in `out`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    out.mkdir(parents=True, exist_ok=True)
    figures = {
        "loss.png": loss_figure(s),
        "step_time.png": step_time_figure(s),
        "device_time.png": device_time_figure(s),
    }
    if trace:
        figures["bubbles.png"] = timeline_figure(trace)
    written = [_save(fig, out / name) for name, fig in figures.items()]
    stacks = (s.get("health") or {}).get("stacks") or []
    if stacks:
        path = out / "stacks.txt"
        path.write_text(stacks_text(stacks))
        written.append(path)
    return written


def stacks_lines(record: dict[str, Any], frames: int = 12) -> list[str]:
    """`spotline stacks`: each rank's process state and its training thread's stack,
    innermost frame first (`frames` of them)."""
    lines = [f"job {record.get('job')}, step {record.get('step')}, group {record.get('attempt')}"]
    ranks = record.get("ranks") or {}
    for key in sorted(ranks, key=int):
        r = ranks[key]
        head = f"rank {key} (node {str(r.get('node'))[:12]}, pid {r.get('pid')}"
        lines.append(head + (f", {r['state']})" if r.get("state") else ")"))
        if r.get("error"):
            lines.append(f"    no stack: {r['error']}")
            continue
        threads = r.get("threads") or []
        frame = r.get("frame")
        training = next((t for t in threads if frame and t["frames"][:1] == [frame]), None)
        shown = training["frames"] if training else [frame or "no training thread found"]
        lines += [f"    {f}" for f in shown[:frames]]
    return lines


def stacks_text(stacks: list[dict[str, Any]]) -> str:
    """Each hang's stacks, as the report's stacks.txt: where each named rank was."""
    lines = []
    for taken in stacks:
        for key, value in stack_rows(taken):
            lines.append(f"{key}: {value}")
        lines.append("")
    return "\n".join(lines)


def _figure(width: float, height: float):
    import matplotlib.pyplot as plt

    # Constrained layout makes room for the legend outside the axes (see `_legend`).
    return plt.subplots(figsize=(width, height), layout="constrained")


def _legend(fig, handles: list, labels: list[str] | None = None) -> None:
    """One legend for the figure, below the axes: inside them it hides what it lies on
    (a flat global-batch line at the top of the loss plot, the bars of a timeline)."""
    if not handles:
        return
    labels = labels if labels is not None else [h.get_label() for h in handles]
    fig.legend(handles, labels, loc="outside lower center", ncols=min(4, len(handles)), fontsize=8)


def loss_figure(s: dict[str, Any]):
    """Train loss, evals and the final held-out loss, with the global batch (right axis)."""
    fig, ax = _figure(8, 4.5)
    losses = sorted((int(k), v) for k, v in (s.get("losses") or {}).items())
    if losses:
        ax.plot(*zip(*losses, strict=True), label="train", lw=1)
    evals = sorted((e["step"], e["loss"]) for e in s.get("evals") or [])
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval (backfill)", ms=4)
    if s.get("heldout_loss") is not None and losses:
        ax.plot([losses[-1][0]], [s["heldout_loss"]], "s", label="held-out (final)")
    handles = ax.get_legend_handles_labels()[0]
    batch = batch_steps(s)
    if batch:
        # The global batch beside the loss: an adaptive schedule's growth shows where
        # the loss curve changes slope.
        right = ax.twinx()
        (line,) = right.plot(
            *zip(*batch, strict=True),
            color="tab:purple",
            lw=1.5,
            ls="--",
            label="global batch (right)",
        )
        right.set_ylabel("global batch (sequences)", color="tab:purple")
        right.set_ylim(bottom=0)
        handles.append(line)
    ax.set(xlabel="step", ylabel="loss", title=f"{s.get('name')}: loss")
    ax.grid(alpha=0.3)
    _legend(fig, handles)
    return fig


def step_time_figure(s: dict[str, Any]):
    """Seconds per step, with saves (periodic and just-in-time), restarts and resizes,
    and peer copies of a fixed interval marked; a spike says which fell in it."""
    fig, ax = _figure(8, 4.5)
    hist = s.get("history") or []
    marks = step_marks(s)
    for i, run in enumerate(_segments(hist)):
        ax.plot(
            [h["step"] for h in run],
            [h["step_s"] for h in run],
            lw=1,
            color="tab:blue",
            label="step time" if i == 0 else None,
        )
    for (step, sec), why in spike_causes(hist, marks).items():
        ax.annotate(
            why,
            (step, sec),
            xytext=(0, 6),
            textcoords="offset points",
            ha="center",
            fontsize=7,
            color="dimgrey",
        )
    styles = {
        "save": ("tab:green", "-", 0.8, "checkpoint save"),
        "notice": ("tab:red", "--", 1.0, "preemption notice (just-in-time save)"),
        "restart": ("tab:orange", ":", 1.5, "restart / resize"),
    }
    for kind, step in marks:
        if kind in styles:
            color, ls, lw, label = styles[kind]
            ax.axvline(step, color=color, ls=ls, lw=lw, alpha=0.7, label=label)
    copies = [step for kind, step in marks if kind == "peer copy"]
    if copies:
        k = (s.get("peer_memory") or {}).get("every_steps")
        ax.plot(
            copies,
            [0] * len(copies),
            "|",
            color="tab:purple",
            ms=8,
            clip_on=False,
            label=f"peer copy (every {k} steps)",
        )
    ax.set_ylim(bottom=0)
    title = f"{s.get('name')}: step time"
    peer = s.get("peer_memory") or {}
    if peer.get("every_steps") and peer.get("chosen") != "fixed":
        title += f" (peer copies every {peer['every_steps']} steps at the end, measured)"
    ax.set(xlabel="step", ylabel="seconds per step", title=title)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    firsts = {label: h for h, label in zip(handles, labels, strict=True)}  # one per kind
    _legend(fig, list(firsts.values()), list(firsts))
    return fig


def _segments(hist: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The history cut where its step goes back (a group resumed from an earlier one)."""
    runs: list[list[dict[str, Any]]] = []
    for h in hist:
        if not runs or h["step"] <= runs[-1][-1]["step"]:
            runs.append([])
        runs[-1].append(h)
    return runs


def step_marks(s: dict[str, Any]) -> list[tuple[str, int]]:
    """(kind, step) of what slows steps: 'save' (committed checkpoints), 'notice' (a
    just-in-time save), 'restart' (resizes, and where the history's step goes back), and
    'peer copy' (every k steps, when k is fixed)."""
    committed = {int(x) for x in s.get("committed_steps") or []}
    jit = {int(n["committed_step"]) for n in s.get("notices") or [] if n.get("committed_step")}
    marks = [("notice" if step in jit else "save", step) for step in committed]
    marks += [("notice", step) for step in jit - committed]
    marks += [("restart", int(r["step"])) for r in s.get("resizes") or []]
    hist = s.get("history") or []
    marks += [("restart", run[0]["step"]) for run in _segments(hist)[1:]]
    peer = s.get("peer_memory") or {}
    k = peer.get("every_steps")
    last = max([h["step"] for h in hist], default=0)
    if k and peer.get("chosen") == "fixed":
        marks += [("peer copy", step) for step in range(k, last + 1, k)]
    return sorted(set(marks), key=lambda m: m[1])


def spike_causes(
    hist: list[dict[str, Any]], marks: list[tuple[str, int]], factor: float = 1.5
) -> dict[tuple[int, float], str]:
    """Points over `factor` x the median seconds per step, with what fell in them since
    the point before ('save', 'restart', ...); a spike with none is left unlabelled."""
    import statistics

    if len(hist) < 3:
        return {}
    median = statistics.median(h["step_s"] for h in hist)
    out: dict[tuple[int, float], str] = {}
    prev = 0
    for h in hist:
        if h["step_s"] > factor * median:
            inside = sorted({kind for kind, step in marks if prev < step <= h["step"]})
            if inside:
                out[(h["step"], h["step_s"])] = " + ".join(inside)
        prev = h["step"] if h["step"] > prev else h["step"] - 1
    return out


PART_NAMES = {
    "useful": "useful compute",
    "data_stall": "waiting for data",
    "bubble_filled": "pipeline bubble, backfilled",
    "bubble_unfilled": "pipeline bubble, idle",
    "checkpoint_stall": "checkpoint saves",
    "recovery": "recovery (restarts)",
    "recomputed": "steps trained again",
    "waiting": "waiting for capacity",
    "startup_other": "start-up and other",
}
"""The goodput ledger's parts (`metrics.ledger.PARTS`) as the charts name them."""


def device_time_unit(total_s: float) -> tuple[str, float]:
    """The unit device time reads best in: (name, seconds per unit)."""
    if total_s >= 2 * 3600:
        return "device-hours", 3600.0
    if total_s >= 120:
        return "device-minutes", 60.0
    return "device-seconds", 1.0


def device_time_figure(s: dict[str, Any]):
    """The goodput ledger as a waterfall: the total, then where each part of it went, in
    a unit that reads (device-seconds, -minutes or -hours), with the share of each."""
    from spotline.metrics.ledger import PARTS

    fig, ax = _figure(9, 4.5)
    parts = (s.get("ledger") or {}).get("device_s") or dict.fromkeys(PARTS, 0.0)
    total = sum(parts.values())
    unit, per = device_time_unit(total)
    bottom = total
    colors = {"useful": "tab:green", "bubble_filled": "tab:olive", "startup_other": "tab:grey"}
    for i, name in enumerate(PARTS):
        v = parts.get(name, 0.0)
        bottom -= v
        ax.bar(i, v / per, bottom=bottom / per, color=colors.get(name, "tab:red"))
        share = f"{v / total:.0%}" if total else "0%"
        ax.text(
            i, (bottom + v) / per, f"{v / per:.2g}\n{share}", ha="center", va="bottom", fontsize=7
        )
    ax.bar(len(PARTS), total / per, color="tab:blue")
    ax.text(len(PARTS), total / per, f"{total / per:.2g}", ha="center", va="bottom", fontsize=7)
    labels = [PART_NAMES.get(p, p) for p in PARTS]
    ax.set_xticks(range(len(PARTS) + 1), [*labels, "total"], rotation=30, ha="right")
    ax.set_ylim(top=total / per * 1.18 if total else 1)
    title = f"{s.get('name')}: where the {unit} went"
    note = startup_note(parts, total)
    if note:
        title += f"\n{note}"
    ax.set(ylabel=unit, title=title)
    return fig


def startup_note(parts: dict[str, float], total: float) -> str | None:
    """A line for a run whose start-up is its largest part (a short run), or None."""
    if not total:
        return None
    start = parts.get("startup_other", 0.0)
    if start < max(parts.values()) or start < 0.2 * total:
        return None
    return (
        f"start-up is {start / total:.0%} of this short run: it is paid once, so goodput "
        "grows with the run"
    )


TIMELINE_COLORS = {
    "compute": "tab:green",
    "comm": "tab:orange",
    "idle": "lightgrey",
    "backfill": "tab:olive",
}


def timeline_figure(trace: dict[str, Any]):
    """One pipeline step of every stage and replica: compute, communication, idle time
    (the bubble) and the backfill work that ran in it. Each category's bars carry it as
    their gid, in the legend's color."""
    from matplotlib.patches import Patch

    names = {
        e["tid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    # One step: the first recorded step of each track, plus the backfill beside it.
    first_step = min((e["args"]["step"] for e in spans if "args" in e), default=None)
    step_spans = [e for e in spans if e.get("args", {}).get("step") == first_step]
    t_end = max((e["ts"] + e["dur"] for e in step_spans), default=0.0)
    shown = step_spans + [e for e in spans if e["cat"] == "backfill" and e["ts"] <= t_end]
    # A track with nothing in this step (a backfill executor that had no work then) is
    # left out rather than drawn as an empty row.
    tids = sorted({e["tid"] for e in shown if e["tid"] in names})
    fig, ax = _figure(10, 0.6 * len(tids) + 2)
    order = list(TIMELINE_COLORS)
    cats = sorted(
        {e["cat"] for e in shown}, key=lambda c: (order.index(c) if c in order else len(order), c)
    )
    colors = {c: TIMELINE_COLORS.get(c, "tab:purple") for c in cats}
    for row, tid in enumerate(tids):
        for cat in cats:
            bars = [
                (e["ts"] / 1e3, e["dur"] / 1e3)
                for e in shown
                if e["tid"] == tid and e["cat"] == cat
            ]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), color=colors[cat], gid=cat)
    ax.set_yticks(range(len(tids)), [names[t] for t in tids])
    ax.invert_yaxis()
    what = "bubbles and backfill" if "backfill" in cats else "bubbles (no backfill ran in it)"
    ax.set(xlabel="ms", title=f"one pipeline step (step {first_step}): {what}")
    _legend(fig, [Patch(facecolor=colors[c], label=c) for c in cats])
    return fig


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def load_json(raw: bytes | None) -> dict[str, Any] | None:
    return None if raw is None else json.loads(raw)
