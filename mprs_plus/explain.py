"""Text and DOT renderings of a Plan: where every node runs, and where queues join them.

Nodes are listed from the output back to the sources, one line each, with the segment,
the process that runs it, and the indices of its parents; queue lines mark boundaries.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .plan import Plan


def describe(datapipe: Any) -> str:
    """A short label: the class name, plus the function of a map/filter-like DataPipe."""
    name = type(datapipe).__name__
    fn = getattr(datapipe, "fn", None) or getattr(datapipe, "filter_fn", None)
    if fn is None:
        return name
    return f"{name}({_callable_name(fn)})"


def _callable_name(fn: Any) -> str:
    if isinstance(fn, functools.partial):
        inner = _callable_name(fn.func)
        shown = [repr(a) for a in fn.args] + [f"{k}={v!r}" for k, v in fn.keywords.items()]
        return f"{inner}[{', '.join(shown)}]" if shown else inner
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _process_label(plan: Plan, segment: Any) -> str:
    if segment.value == "worker":
        return f"worker x{plan.num_workers}"
    if segment.value == "dispatch":
        return "dispatch process"
    return "main process"


def explain_text(plan: Plan) -> str:
    graph = plan.graph
    order = list(reversed(graph.topological()))
    processes = "in-process" if not plan.uses_processes else (
        f"{plan.num_workers} worker process{'es' if plan.num_workers != 1 else ''}"
        + (" + 1 dispatch process" if plan.dispatchers else "")
        + " + main"
    )
    lines = [f"Plan: {len(graph.nodes)} DataPipes, {processes}"]
    width = max(len(describe(dp)) for dp in graph.datapipes) + 6
    boundary_after = _boundary_texts(plan)
    for index in order:
        node = graph.nodes[index]
        segment = plan.segments[index]
        label = f"#{index} {describe(graph.datapipes[index])}"
        parents = ", ".join(f"#{p}" for p in node.parents) or "source"
        lines.append(f"  {segment.value:<8}  {label:<{width}} <- {parents:<12} [{_process_label(plan, segment)}]")
        if index in boundary_after and plan.uses_processes:
            lines.append(f"  {'':<8}  ~~~ queue: {boundary_after[index]} ~~~")
    if plan.sharding_points:
        lines.append("sharding points: " + ", ".join(f"#{i}" for i in plan.sharding_points))
    for warning in plan.warnings:
        lines.append(f"WARNING: {warning}")
    return "\n".join(lines)


def _boundary_texts(plan: Plan) -> dict[int, str]:
    """The queue line after each boundary node; with several outputs (or dispatchers),
    which one it is: each has its own queues and its own thread in its process."""
    found: dict[int, str] = {}
    outputs, dispatchers = plan.worker_outputs, plan.dispatchers
    for k, index in enumerate(outputs):
        which = f"worker output {k + 1} of {len(outputs)}" if len(outputs) > 1 else "worker outputs"
        lane = "; a thread per output in each worker" if len(outputs) > 1 else ""
        found[index] = f"{which} -> main (queue per worker, round-robin{lane})"
    for d, index in enumerate(dispatchers):
        which = f"dispatcher {d + 1} of {len(dispatchers)}" if len(dispatchers) > 1 else "dispatch"
        lane = "; a thread per dispatcher in the dispatch process" if len(dispatchers) > 1 else ""
        text = f"{which} -> {plan.num_workers} workers (queue per worker, round-robin{lane})"
        found[index] = f"{found[index]}; {text}" if index in found else text
    return found


_COLOURS = {"main": "#dbe9ff", "worker": "#dff5d8", "dispatch": "#ffe9cc"}


def explain_dot(plan: Plan) -> str:
    graph = plan.graph
    lines = ["digraph plan {", "  rankdir=BT;", '  node [shape=box, style=filled, fontname="Helvetica"];']
    for segment in ("dispatch", "worker", "main"):
        members = [i for i, s in enumerate(plan.segments) if s.value == segment]
        if not members:
            continue
        title = {"dispatch": "dispatch process", "worker": f"worker processes x{plan.num_workers}", "main": "main process"}[segment]
        lines.append(f"  subgraph cluster_{segment} {{")
        lines.append(f'    label="{title}"; style=rounded;')
        for index in members:
            label = describe(graph.datapipes[index]).replace('"', r"\"")
            lines.append(f'    n{index} [label="#{index} {label}", fillcolor="{_COLOURS[segment]}"];')
        lines.append("  }")
    for node in graph.nodes:
        for parent in node.parents:
            crosses = plan.segments[parent] is not plan.segments[node.index]
            style = ' [style=dashed, label="queue"]' if crosses and plan.uses_processes else ""
            lines.append(f"  n{parent} -> n{node.index}{style};")
    lines.append("}")
    return "\n".join(lines)
