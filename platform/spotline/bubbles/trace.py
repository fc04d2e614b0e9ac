"""Chrome-trace JSON of a job's pipeline steps (opens in Perfetto and chrome://tracing).

One track per stage and replica with its instructions as slices, coloured by
kind (compute, communication, idle), and beside it a track with the backfill
units its executor ran. Each rank's timestamps are its own node's monotonic
clock, aligned so that every rank's first recorded step starts at the same
instant: the ranks agree at the end of every step, so step starts line up to
within that agreement's latency.
"""

from __future__ import annotations

from typing import Any

from spotline.bubbles.schedule import COMM, WAITS

_CNAME = {"compute": "good", "comm": "yellow", "idle": "grey", "backfill": "olive"}


def category(name: str) -> str:
    if name in WAITS:
        return "idle"
    if name in COMM:
        return "comm"
    return "compute"


def chrome_trace(ranks: list[dict[str, Any]], job: str = "") -> dict[str, Any]:
    """`ranks`: per rank, the `bubbles` dict a worker reports (stage, replica,
    steps_timeline) plus optional `slices` [(start_ns, end_ns, label)] of its executor."""
    events: list[dict[str, Any]] = []
    tracks = sorted(ranks, key=lambda r: (r["stage"], r["replica"]))
    for tid, r in enumerate(tracks):
        steps = r.get("steps_timeline") or []
        if not steps:
            continue
        name = f"stage-{r['stage']}/replica-{r['replica']}"
        events.append(_meta(tid * 2, name))
        events.append(_meta(tid * 2 + 1, f"{name} backfill"))
        origin_ns = steps[0]["start_ns"]
        last_end_ns = origin_ns
        for st in steps:
            base_us = (st["start_ns"] - origin_ns) / 1e3
            for instr_name, slot, start, end in st["instrs"]:
                cat = category(instr_name)
                events.append(
                    {
                        "name": instr_name,
                        "cat": cat,
                        "ph": "X",
                        "ts": base_us + start * 1e6,
                        "dur": max(0.0, (end - start) * 1e6),
                        "pid": 1,
                        "tid": tid * 2,
                        "cname": _CNAME[cat],
                        "args": {"step": st["step"], "slot": slot},
                    }
                )
            if st["instrs"]:
                last_end_ns = st["start_ns"] + int(st["instrs"][-1][3] * 1e9)
        for s_ns, e_ns, label in r.get("slices") or []:
            if e_ns < origin_ns or s_ns > last_end_ns:
                continue  # outside the recorded steps
            events.append(
                {
                    "name": label,
                    "cat": "backfill",
                    "ph": "X",
                    "ts": (s_ns - origin_ns) / 1e3,
                    "dur": (e_ns - s_ns) / 1e3,
                    "pid": 1,
                    "tid": tid * 2 + 1,
                    "cname": _CNAME["backfill"],
                }
            )
    events.append(
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": job or "spotline"}}
    )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _meta(tid: int, name: str) -> dict[str, Any]:
    return {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}}


def summarize(trace: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Seconds per category per track name, from a trace (for reports and tests)."""
    names = {
        e["tid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e.get("ph") == "M" and e["name"] == "thread_name"
    }
    out: dict[str, dict[str, float]] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        track = out.setdefault(names.get(e["tid"], str(e["tid"])), {})
        track[e["cat"]] = track.get(e["cat"], 0.0) + e["dur"] / 1e6
    return out


def cut_steps(trace: dict[str, Any], first: int, last: int) -> dict[str, Any]:
    """`trace` (what `chrome_trace` wrote) cut to steps `first`..`last`, with the backfill
    that ran while they did; ValueError naming the steps it holds when it holds none of
    them."""
    events = trace.get("traceEvents") or []
    recorded = sorted({e["args"]["step"] for e in events if "step" in (e.get("args") or {})})
    kept = [e for e in events if first <= (e.get("args") or {}).get("step", -1) <= last]
    if not kept:
        have = f"steps {recorded[0]}-{recorded[-1]}" if recorded else "no steps"
        raise ValueError(
            f"--steps {first}-{last}: the job's trace holds {have} (the last recorded steps "
            "of each rank); pick steps in that range"
        )
    start = min(e["ts"] for e in kept)
    end = max(e["ts"] + e["dur"] for e in kept)
    side = [
        e
        for e in events
        if e.get("cat") == "backfill" and e.get("ph") == "X" and start <= e["ts"] <= end
    ]
    meta = [e for e in events if e.get("ph") == "M"]
    other = {**(trace.get("otherData") or {}), "steps": [first, last]}
    return {**trace, "traceEvents": [*meta, *kept, *side], "otherData": other}
