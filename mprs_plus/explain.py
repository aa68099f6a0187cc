r"""Text and DOT renderings of a Plan: where every DataPipe runs and where queues join them.

Both renderings read the Plan only; they never iterate a DataPipe or start a process,
so a user can look at a pipeline before running it::

    Plan --explain_text--> str    sources first, one section per process, queue lines
    Plan --explain_dot---> str    one Graphviz cluster per process, queues as dashed edges
                            \--render_dot--> bytes   svg or png; optional: graphviz + dot

Rendering to an image is the only step with I/O (it runs Graphviz's ``dot``), and the
only one with an optional dependency; the DOT text needs nothing.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .errors import GraphvizNotFound
from .graph import describe
from .segment import Segment

if TYPE_CHECKING:
    from .graph import Node
    from .plan import Plan

RENDER_FORMATS = ("svg", "png")

_WRAP = 96  # warnings are long sentences; wrap them for terminals and image captions


# -- what both renderings say -------------------------------------------------------------


def _headline(plan: Plan) -> str:
    count = f"{len(plan.graph.nodes)} DataPipe{'s' if len(plan.graph.nodes) != 1 else ''}"
    if plan.num_workers == 0:
        return f"Plan for num_workers=0: {count}, all in the calling process"
    if not plan.uses_processes:
        return f"Plan for num_workers={plan.num_workers}: {count}, all in the main process (no process starts)"
    kinds = (["1 dispatch"] if plan.dispatchers else []) + [
        f"{plan.num_workers} worker{'s' if plan.num_workers != 1 else ''}",
        "1 main",
    ]
    total = plan.num_workers + 1 + (1 if plan.dispatchers else 0)
    return f"Plan for num_workers={plan.num_workers}: {count} in {total} processes ({', '.join(kinds)})"


def _section_title(plan: Plan, segment: Segment) -> str:
    if segment is Segment.DISPATCH:
        return "dispatch process: runs once, deals items round-robin to the workers"
    if segment is Segment.WORKER:
        return f"worker processes x{plan.num_workers}: each runs its own replica of these DataPipes"
    if plan.uses_processes:
        return "main process: reads the workers' queues round-robin"
    return "calling process" if plan.num_workers == 0 else "main process"


def _tags(plan: Plan, index: int) -> list[str]:
    tags = []
    if index in plan.dispatchers:
        tags.append("dispatcher")
    if index in plan.sharding_points:
        tags.append("sharding point")
    if index == plan.graph.output:
        tags.append("output")
    return tags


def _sharding_summary(plan: Plan) -> str | None:
    if plan.num_workers == 0:
        return None
    parts = [f"#{i} deals items round-robin to the {plan.num_workers} workers" for i in plan.dispatchers]
    for index in plan.sharding_points:
        name = f"#{index} {describe(plan.graph.datapipes[index])}"
        if any(plan.segments[i] is Segment.DISPATCH for i in plan.graph.ancestors(index)):
            # Its input was dealt out already, so the worker does not shard it again.
            parts.append(f"{name} keeps every item (the dispatcher already dealt them out)")
        else:
            parts.append(f"{name} splits its input across the {plan.num_workers} workers")
    return "Sharding: " + ("; ".join(parts) if parts else "none")


def _queue_text(plan: Plan, index: int) -> list[str]:
    """The boundaries leaving node ``index``, as one sentence each."""
    if not plan.uses_processes:
        return []
    found = []
    dispatchers, outputs = plan.dispatchers, plan.worker_outputs
    if index in dispatchers:
        which = f" (dispatcher {dispatchers.index(index) + 1} of {len(dispatchers)}, its own thread)" if len(dispatchers) > 1 else ""
        found.append(f"queue to each of the {plan.num_workers} workers, items dealt round-robin{which}")
    if index in outputs:
        which = f" (worker output {outputs.index(index) + 1} of {len(outputs)}, a thread per output in each worker)" if len(outputs) > 1 else ""
        found.append(f"queue from each worker to the main process, read round-robin{which}")
    return found


def _segments_in_order(plan: Plan) -> Iterable[tuple[Segment, list[int]]]:
    order = plan.graph.topological()
    for segment in (Segment.DISPATCH, Segment.WORKER, Segment.MAIN):
        members = [i for i in order if plan.segments[i] is segment]
        # The main process always reads the workers, even with no DataPipe of its own.
        if members or (segment is Segment.MAIN and plan.uses_processes):
            yield segment, members


def _paths_by_parent(plan: Plan, node: Node) -> dict[int, list[str]]:
    """Every path a parent was found at, as the user's code names it: two paths to one
    parent is a side reference."""
    paths: dict[int, list[str]] = {}
    for edge in node.edges:
        paths.setdefault(edge.parent, []).append(_attribute_name(plan, node, edge))
    return paths


def _attribute_name(plan: Plan, node: Node, edge: Any) -> str:
    """The attribute that holds the input, as in the DataPipe's code (``datapipe``). A class
    whose ``__getstate__`` returns a tuple was walked by position (``__getstate__()[0]``),
    which no user wrote: name the attribute holding the same object instead."""
    if not edge.steps or edge.steps[0][0] != "state":
        return edge.path
    owner, parent = plan.graph.datapipes[node.index], plan.graph.datapipes[edge.parent]
    for name, value in getattr(owner, "__dict__", {}).items():
        if value is parent:
            return name
        if isinstance(value, (list, tuple)):
            for position, member in enumerate(value):
                if member is parent:
                    return f"{name}[{position}]"
    return f"input {edge.steps[0][1] + 1}"


def _inputs(plan: Plan, node: Node) -> str:
    """``#6 (source_datapipe)``, one entry per parent."""
    return ", ".join(f"#{parent} ({', '.join(found)})" for parent, found in _paths_by_parent(plan, node).items())


def _wrapped(prefix: str, text: str) -> list[str]:
    return textwrap.wrap(text, _WRAP, initial_indent=prefix, subsequent_indent=" " * len(prefix))


# -- text -------------------------------------------------------------------------------------


def explain_text(plan: Plan) -> str:
    """Sources first, one section per process, the queues between them, then sharding and
    warnings. Node numbers are graph indices (#0 is the output) and match ``to_dot()``."""
    graph = plan.graph
    labels = {i: f"#{i} {describe(dp)}" for i, dp in enumerate(graph.datapipes)}
    width = min(max(len(label) for label in labels.values()), 60)
    lines = [_headline(plan)]
    for segment, members in _segments_in_order(plan):
        lines += ["", f"[{_section_title(plan, segment)}]"]
        if not members:
            lines.append(f"  (no DataPipe of its own: #{graph.output}, the output, runs in the workers)")
        for index in members:
            node = graph.nodes[index]
            inputs = f"<- {_inputs(plan, node)}" if node.edges else "(source)"
            tags = ", ".join(_tags(plan, index))
            shown_tags = f"  [{tags}]" if tags else ""
            lines.append(f"  {labels[index]:<{width}}  {inputs}{shown_tags}".rstrip())
            lines += [f"    ==> {queue}" for queue in _queue_text(plan, index)]
    lines.append("")
    if plan.delivery is not None:
        lines += _wrapped("", f"Items reach the loop {plan.delivery}.")
    sharding = _sharding_summary(plan)
    if sharding is not None:
        lines += _wrapped("", sharding)
    if not plan.warnings:
        lines.append("Warnings: none")
    for warning in plan.warnings:
        lines += _wrapped("WARNING: ", warning)
    return "\n".join(lines)


# -- DOT --------------------------------------------------------------------------------------

_FILL = {Segment.DISPATCH: "#ffe9cc", Segment.WORKER: "#dff5d8", Segment.MAIN: "#dbe9ff"}
_BACKGROUND = {Segment.DISPATCH: "#fff7ec", Segment.WORKER: "#f3fbf0", Segment.MAIN: "#f0f5ff"}


_CENTRE, _LEFT = r"\n", r"\l"  # DOT's line breaks; "\l" left-aligns the line it ends


def _quote(*lines: str, end: str = _CENTRE) -> str:
    """A DOT string of ``lines``, escaped; left-aligned lines each need their own break."""
    escaped = [line.replace("\\", "\\\\").replace('"', '\\"') for line in lines]
    return '"' + end.join(escaped) + ("" if end == _CENTRE else end) + '"'


def explain_dot(plan: Plan) -> str:
    """One cluster per process kind (the worker cluster names its replica count), queues as
    dashed edges, sharding points and dispatchers drawn bold, the output doubled, and the
    headline, sharding and warnings as the caption. Node ids are ``n<index>``."""
    graph = plan.graph
    caption = [_headline(plan)]
    sharding = _sharding_summary(plan)
    if sharding is not None:
        caption += _wrapped("", sharding)
    for warning in plan.warnings:
        caption += _wrapped("WARNING: ", warning)
    caption_text = _quote(*caption, end=_LEFT)
    lines = [
        "digraph plan {",
        f"  graph [rankdir=TB, fontname=Helvetica, fontsize=11, labelloc=b, labeljust=l, label={caption_text}];",
        '  node [shape=box, style="rounded,filled", fontname=Helvetica, fontsize=11];',
        "  edge [fontname=Helvetica, fontsize=9];",
    ]
    for segment, members in _segments_in_order(plan):
        lines.append(f"  subgraph cluster_{segment.value} {{")
        lines.append(
            f'    label={_quote(_section_title(plan, segment))}; style="rounded,filled"; '
            f'fillcolor="{_BACKGROUND[segment]}"; color="#888888"; labelloc=t;'
        )
        for index in members:
            tags = _tags(plan, index)
            attributes = [f"label={_quote(f'#{index} {describe(graph.datapipes[index])}', *tags)}"]
            attributes.append(f'fillcolor="{_FILL[segment]}"')
            if index in plan.dispatchers or index in plan.sharding_points:
                attributes.append("penwidth=2")
            if index == graph.output:
                attributes.append("peripheries=2")
            lines.append(f"    n{index} [{', '.join(attributes)}];")
        if not members:
            lines.append('    main_reader [label="(no DataPipe of its own)", shape=plaintext, style=""];')
        lines.append("  }")
    for node in graph.nodes:
        for parent, found in _paths_by_parent(plan, node).items():
            attributes = _edge_attributes(plan, parent, node.index, found, len(node.edges))
            lines.append(f"  n{parent} -> n{node.index}{attributes};")
    if plan.uses_processes and plan.segments[graph.output] is not Segment.MAIN:
        lines.append(f'  n{graph.output} -> main_reader [style=dashed, label="queue per worker"];')
    lines.append("}")
    return "\n".join(lines)


def _edge_attributes(plan: Plan, parent: int, child: int, paths: list[str], edges_of_child: int) -> str:
    label = list(paths) if edges_of_child > 1 else []  # name references only where there is a choice
    attributes = []
    if plan.uses_processes and plan.segments[parent] is not plan.segments[child]:
        label.append("queue per worker")
        attributes += ["style=dashed", "penwidth=1.5"]
    if label:
        attributes.insert(0, f"label={_quote(*label)}")
    return f" [{', '.join(attributes)}]" if attributes else ""


# -- images -----------------------------------------------------------------------------------


def render_dot(dot: str, format: str = "svg") -> bytes:
    """Draw DOT text as ``"svg"`` or ``"png"`` with Graphviz.

    Needs the optional ``graphviz`` Python package and Graphviz's ``dot`` program; raises
    ``GraphvizNotFound`` saying which one is missing, so callers can fall back to DOT text.
    """
    if format not in RENDER_FORMATS:
        raise ValueError(f"format must be one of {RENDER_FORMATS}, got {format!r}")
    try:
        import graphviz
    except ImportError:
        raise GraphvizNotFound(
            f"drawing the plan as {format.upper()} needs the graphviz Python package, which is not "
            "installed: pip install graphviz (and Graphviz's dot program), or use the DOT text "
            "(to_dot(), --format dot) with any Graphviz viewer"
        ) from None
    try:
        return graphviz.Source(dot).pipe(format=format)
    except graphviz.ExecutableNotFound:
        raise GraphvizNotFound(
            f"drawing the plan as {format.upper()} needs Graphviz's dot program, which is not on "
            "PATH: install Graphviz (e.g. apt-get install graphviz, brew install graphviz), or use "
            "the DOT text (to_dot(), --format dot) with any Graphviz viewer"
        ) from None
