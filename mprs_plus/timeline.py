"""The timeline of a run, as people read it: Chrome's trace-event format, which Perfetto
(ui.perfetto.dev), ``chrome://tracing`` and ``python -m mprs_plus timeline`` show.

    the rings (runtime/timeline.py) --Stats.timeline()--> trace events --write--> trace.json
                                                                       --render--> timeline.html
                                                                       --merge_into--> a torch.profiler trace

One track per process and lane: the main process (its loop, and the service's events),
the dispatch process, each worker; a replaced worker's every life its own process, named
"worker 1, life 2". Times are microseconds from the service's start (``ts``); every
span is a complete event (``"ph": "X"``) and the spans of a track nest.

Plain functions over plain data: loaded when a timeline is asked for, never on the path
of a loader's items.
"""

from __future__ import annotations

import bisect
import html
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .runtime.timeline import INSTANTS, Span

# What each record is called, per role where it differs (the docs' "What each span means").
NAMES: dict[int, str] = {
    Span.BUSY: "busy",
    Span.WAIT_INPUT: "waiting for input",
    Span.SENDING: "sending",
    Span.ASLEEP: "waiting for space",
    Span.NEXT: "next(): waiting for a batch",
    Span.STEP: "your step",
    Span.RECEIVING: "receiving",
    Span.STARTUP: "starting",
    Span.EPOCH: "epoch {argument} begins",
    Span.EPOCH_END: "epoch ends",
    Span.SAVE: "checkpoint saved",
    Span.RESTORE: "checkpoint restored",
    Span.DEATH: "died",
    Span.REPLACING: "replacing worker {argument}",
    Span.WATCHDOG: "watchdog: worker {argument} may be stuck",
    Span.LIFE: "started",
    Span.REPLAY: "replaying",
    Span.WAIT_WINDOW: "waiting for space",
    Span.RESET: "epoch {argument} set-up",
}
_MAIN_NAMES: dict[int, str] = {Span.WAIT_INPUT: "waiting for the workers"}
_CHILD_NAMES: dict[int, str] = {Span.STARTUP: "setting up"}
_CATEGORY = "mprs_plus"


def trace_events(
    rings: Sequence[tuple[Any, int, int, list[tuple[int, int, float, float, float]]]],
    origin: float,
    causes: Mapping[int, str] | None = None,
) -> list[dict[str, Any]]:
    """The trace events of ``rings`` (``TimelineSource.read()``), times from ``origin``
    (``time.perf_counter()`` of the service's start); ``causes``: a dead worker's cause of
    death by its pid (``Stats.replacements``)."""
    causes = dict(causes or {})
    main_pid = next((records[0][0] for role, _, _, records in rings if role == "main" and records), os.getpid())
    owner: dict[int, tuple[str, int]] = {}  # pid -> (role, worker index)
    first_seen: dict[int, float] = {}
    events: list[dict[str, Any]] = []
    deaths: list[tuple[int, float]] = []

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    for role, index, lane, records in rings:
        role = str(role)
        inputs = sorted((s, e) for _, k, s, e, _ in records if k == Span.WAIT_INPUT)
        for pid, kind, start, end, argument in records:
            span = kind
            if span not in NAMES:
                continue  # a record torn by a writer that died mid-store
            if role == "service":
                pid, tid = main_pid, 1
                if span == Span.DEATH:  # on the dead life's own track
                    deaths.append((int(argument), start))
                    continue
            else:
                tid = lane
                owner.setdefault(pid, (role, index))
            first_seen[pid] = min(first_seen.get(pid, start), start)
            if span == Span.ASLEEP and _within(inputs, start, end):
                continue  # a sleep waiting for input: the wait for input says it already
            name = (_MAIN_NAMES if role == "main" else _CHILD_NAMES).get(span) or NAMES[span]
            name = name.format(argument=int(argument))
            ts = us(start)
            if span in INSTANTS:
                events.append({"ph": "i", "s": "t", "name": name, "cat": _CATEGORY, "pid": pid, "tid": tid, "ts": ts})
            else:
                duration = round(us(end) - ts, 3)
                events.append(
                    {"ph": "X", "name": name, "cat": _CATEGORY, "pid": pid, "tid": tid, "ts": ts, "dur": duration}
                )
    for pid, at in deaths:
        cause = causes.get(pid)
        events.append(
            {
                "ph": "i",
                "s": "t",
                "name": f"died ({cause})" if cause else "died",
                "cat": _CATEGORY,
                "pid": pid,
                "tid": 0,
                "ts": us(at),
            }
        )
        owner.setdefault(pid, ("worker", -1))
        first_seen.setdefault(pid, at)
    owner.setdefault(main_pid, ("main", 0))
    events.sort(key=lambda e: (e["pid"], e["tid"], e["ts"], -e.get("dur", 0.0)))
    return _metadata(owner, first_seen, main_pid, events) + events


def _within(spans: list[tuple[float, float]], start: float, end: float) -> bool:
    """Whether one of ``spans`` (sorted, disjoint: one lane's) holds ``start``..``end``."""
    at = bisect.bisect_right(spans, (start, float("inf"))) - 1
    return at >= 0 and spans[at][0] <= start and end <= spans[at][1]


def _metadata(
    owner: Mapping[int, tuple[str, int]],
    first_seen: Mapping[int, float],
    main_pid: int,
    events: Iterable[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Names and order of the tracks: main, dispatch, then each worker's lives in order."""
    lives: dict[tuple[str, int], list[int]] = {}
    for pid in sorted(owner, key=lambda p: first_seen.get(p, 0.0)):
        lives.setdefault(owner[pid], []).append(pid)
    found: list[dict[str, Any]] = []
    order = {"main": 0, "dispatch": 1, "worker": 2}
    for (role, index), pids in lives.items():
        for life, pid in enumerate(pids, 1):
            name = "main" if role == "main" else "dispatch" if role == "dispatch" else f"worker {index}"
            if life > 1:
                name += f", life {life}"
            sort = order.get(role, 3) * 100000 + max(index, 0) * 100 + life
            label = {"name": f"{name} (pid {pid})"}
            found.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": label})
            found.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": sort}})
    tids = sorted({(e["pid"], e["tid"]) for e in events})
    for pid, tid in tids:
        if pid == main_pid:
            label = "service" if tid == 1 else "loop"
        else:
            label = f"lane {tid}"
        found.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})
    return found


def trace(source: Any, causes: Mapping[int, str] | None = None) -> dict[str, Any]:
    """The trace-event JSON object of a recorded timeline (``TimelineSource``)."""
    table = source.table
    return {
        "traceEvents": trace_events(source.read(), table.origin, causes),
        "displayTimeUnit": "ms",
        "otherData": {
            "producer": "mprs_plus",
            # Where ts = 0 is: the service's start, as unix time (merge_into aligns with it).
            "origin_unix_us": round(table.wall_origin * 1e6, 3),
        },
    }


def merge_into(torch_trace: str | os.PathLike[str], timeline: Mapping[str, Any], out: str | os.PathLike[str]) -> str:
    """Write to ``out`` the trace ``torch.profiler`` exported (``export_chrome_trace``)
    with the timeline's tracks added, on torch's clock: torch writes ``ts`` as microseconds
    since its ``baseTimeNanoseconds`` (unix time), ours count from the service's start,
    whose unix time the timeline records. The main process's tracks move to a process of
    their own ("mprs_plus main"), so that torch's names for it stay as they are."""
    with open(torch_trace) as f:
        merged = json.load(f)
    base_us = merged.get("baseTimeNanoseconds", 0) / 1000
    shift = timeline["otherData"]["origin_unix_us"] - base_us
    events = timeline["traceEvents"]
    main_pids = {
        e["pid"]
        for e in events
        if e["ph"] == "M" and e["name"] == "process_name" and e["args"]["name"].startswith("main")
    }
    added = []
    for event in events:
        event = dict(event)
        if event["pid"] in main_pids:
            event["pid"] = f"mprs_plus main {event['pid']}"
            if event["ph"] == "M" and event["name"] == "process_name":
                event["args"] = {"name": "mprs_plus: " + event["args"]["name"]}
        if "ts" in event:
            event["ts"] = round(event["ts"] + shift, 3)
        added.append(event)
    merged.setdefault("traceEvents", []).extend(added)
    with open(out, "w") as f:
        json.dump(merged, f)
    return os.fspath(out)


# -- a page of its own: python -m mprs_plus timeline trace.json -o timeline.html --------------

_COLOURS = {
    "busy": "#4c9a2a",
    "your step": "#17becf",
    "waiting for input": "#d9a520",
    "waiting for the workers": "#d9a520",
    "next(): waiting for a batch": "#c0504d",
    "sending": "#4f81bd",
    "waiting for space": "#8064a2",
    "receiving": "#7fb2e5",
    "starting": "#9e9e9e",
    "setting up": "#9e9e9e",
    "epoch N set-up": "#bcbd22",
    "replaying": "#f79646",
    "replacing worker": "#d62728",
    "checkpoint saved": "#2c7fb8",
    "checkpoint restored": "#2c7fb8",
}
_ROW, _LABEL, _WIDTH, _AXIS = 22, 230, 1600, 28


def render_html(timeline: Mapping[str, Any], start_ms: float | None = None, end_ms: float | None = None) -> str:
    """A self-contained page (inline SVG, no script, nothing fetched) showing ``timeline``:
    a row per track, spans as bars (nested ones thinner, inside their parent), instants as
    marks; ``start_ms``/``end_ms``: the window shown, in ms from the service's start."""
    events = timeline["traceEvents"]
    names: dict[int | str, str] = {}
    sort: dict[int | str, int] = {}
    threads: dict[tuple[Any, Any], str] = {}
    for e in events:
        if e["ph"] == "M" and e["name"] == "process_name":
            names[e["pid"]] = e["args"]["name"]
        elif e["ph"] == "M" and e["name"] == "process_sort_index":
            sort[e["pid"]] = e["args"]["sort_index"]
        elif e["ph"] == "M" and e["name"] == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    timed = [e for e in events if e["ph"] in ("X", "i")]
    if not timed:
        return "<!doctype html><meta charset=utf-8><title>mprs_plus timeline</title><p>The timeline is empty."
    lo = min(e["ts"] for e in timed) / 1000 if start_ms is None else start_ms
    hi = max(e["ts"] + e.get("dur", 0) for e in timed) / 1000 if end_ms is None else end_ms
    hi = max(hi, lo + 1e-3)
    tracks = sorted({(e["pid"], e["tid"]) for e in timed}, key=lambda t: (sort.get(t[0], 10**9), str(t[0]), t[1]))
    row_of = {track: i for i, track in enumerate(tracks)}
    scale = _WIDTH / (hi - lo)

    def x(ms: float) -> float:
        return _LABEL + (min(max(ms, lo), hi) - lo) * scale

    height = _AXIS + len(tracks) * _ROW + 60
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_LABEL + _WIDTH + 20}" height="{height}" '
        'font-family="sans-serif" font-size="11">',
        '<rect width="100%" height="100%" fill="white"/>',
    ]
    for i, track in enumerate(tracks):
        y = _AXIS + i * _ROW
        if i % 2:
            parts.append(f'<rect x="0" y="{y}" width="{_LABEL + _WIDTH}" height="{_ROW}" fill="#f4f4f4"/>')
        label = f"{names.get(track[0], track[0])} · {threads.get(track, track[1])}"
        parts.append(f'<text x="4" y="{y + 15}">{html.escape(label)}</text>')
    # The axis: ticks at a round step.
    step = _round_step((hi - lo) / 10)
    tick = (lo // step + 1) * step if lo % step else lo
    while tick <= hi:
        parts.append(f'<line x1="{x(tick):.1f}" x2="{x(tick):.1f}" y1="{_AXIS - 4}" y2="{height - 60}" stroke="#ddd"/>')
        parts.append(f'<text x="{x(tick):.1f}" y="{_AXIS - 8}" text-anchor="middle">{_ms(tick)}</text>')
        tick += step
    # Spans, outer first: a nested span is drawn thinner, inside its parent's bar. Spans of one
    # colour closer than half a pixel are drawn as one bar: a long run's page stays small.
    stacks: dict[tuple[Any, Any], list[float]] = {}
    bars: list[list[Any]] = []  # [x0, x1, y, height, colour, names]
    last: dict[tuple[Any, Any, int], list[Any]] = {}
    spans = sorted(
        (e for e in timed if e["ph"] == "X"), key=lambda e: (row_of[(e["pid"], e["tid"])], e["ts"], -e["dur"])
    )
    for e in spans:
        start, end = e["ts"] / 1000, (e["ts"] + e["dur"]) / 1000
        if end < lo or start > hi:
            continue
        stack = stacks.setdefault((e["pid"], e["tid"]), [])
        while stack and stack[-1] <= start:
            stack.pop()
        depth = len(stack)
        stack.append(end)
        y = _AXIS + row_of[(e["pid"], e["tid"])] * _ROW + 2 + depth * 4
        h = max(4, _ROW - 4 - depth * 8)
        colour = _colour(e["name"])
        x0, x1 = x(start), x(end)
        previous = last.get((e["pid"], e["tid"], depth))
        if previous is not None and previous[4] == colour and x0 <= previous[1] + 0.5:
            previous[1] = max(previous[1], x1)
            previous[5].append(e)
            continue
        bar = [x0, x1, y, h, colour, [e]]
        bars.append(bar)
        last[(e["pid"], e["tid"], depth)] = bar
    for x0, x1, y, h, colour, merged in bars:
        first = merged[0]
        if len(merged) == 1:
            title = f"{first['name']}: {_ms(first['ts'] / 1000)} + {first['dur'] / 1000:.3f} ms"
        else:
            title = f"{len(merged)} spans of {first['name']} from {_ms(first['ts'] / 1000)}"
        parts.append(
            f'<rect x="{x0:.2f}" y="{y}" width="{max(0.6, x1 - x0):.2f}" height="{h}" fill="{colour}">'
            f"<title>{html.escape(title)}</title></rect>"
        )
    for e in timed:
        if e["ph"] != "i":
            continue
        at = e["ts"] / 1000
        if at < lo or at > hi:
            continue
        y = _AXIS + row_of[(e["pid"], e["tid"])] * _ROW
        died = e["name"].startswith("died")
        colour = "#d00" if died or e["name"].startswith("watchdog") else "#000"
        mark = f'<path d="M{x(at):.1f},{y + 2} l4,8 l-8,0 z" fill="{colour}">'
        parts.append(f"{mark}<title>{html.escape(e['name'])}</title></path>")
        if died or e["name"].startswith(("epoch", "watchdog")):
            parts.append(f'<text x="{x(at) + 6:.1f}" y="{y + 19}" fill="{colour}">{html.escape(e["name"])}</text>')
    # The legend.
    y = height - 40
    seen = {_key(e["name"]) for e in timed if e["ph"] == "X"}
    shown = [name for name in _COLOURS if name in seen]
    for i, name in enumerate(shown):
        lx = _LABEL + (i % 6) * 260
        ly = y + (i // 6) * 16
        parts.append(f'<rect x="{lx}" y="{ly}" width="12" height="10" fill="{_COLOURS[name]}"/>')
        parts.append(f'<text x="{lx + 16}" y="{ly + 9}">{html.escape(name)}</text>')
    parts.append("</svg>")
    title = "mprs_plus timeline"
    return (
        f"<!doctype html>\n<html><head><meta charset=utf-8><title>{title}</title>"
        "<style>body{margin:8px;font-family:sans-serif}</style></head><body>\n"
        f"<div>{title}: {_ms(lo)} to {_ms(hi)} after the service's start; hover a bar for its name and length.</div>\n"
        + "\n".join(parts)
        + "\n</body></html>\n"
    )


def _key(name: str) -> str | None:
    """The legend's entry for a span's name ("replacing worker 1": "replacing worker")."""
    if name in _COLOURS:
        return name
    if name.startswith("epoch ") and name.endswith(" set-up"):
        return "epoch N set-up"
    return next((known for known in _COLOURS if name.startswith(known)), None)


def _colour(name: str) -> str:
    key = _key(name)
    return _COLOURS[key] if key is not None else "#7f7f7f"


def _round_step(raw: float) -> float:
    for unit in (1e-3, 1e-2, 1e-1, 1, 10, 100, 1000, 10000, 100000, 1000000):
        for factor in (1, 2, 5):
            if unit * factor >= raw:
                return unit * factor
    return raw


def _ms(value: float) -> str:
    return f"{value / 1000:.3g} s" if abs(value) >= 1000 else f"{value:.4g} ms"
