"""Split a Graph into segments. Pure: no processes, no I/O.

    dispatch   every sharding_round_robin_dispatch node and everything upstream of it;
               runs once, in one dispatch process
    worker     replicable nodes downstream of the dispatchers (or of the sources), up to
               the first non-replicable node; replicated in every worker process
    main       the first non-replicable node and everything downstream of it

A reference that straddles two segments in a way the split cannot honour raises
``AmbiguousGraphError`` here, before any process starts.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, NamedTuple

from torch.utils.data import IterDataPipe
from torch.utils.data.datapipes.iter.callable import CollatorIterDataPipe

from .errors import AmbiguousGraphError, PlanError
from .graph import Edge, Graph, NoGraph, Node, describe, discover
from .segment import Segment


class Plan(NamedTuple):
    """Where every node of a graph runs, computed once in the main process. Immutable; a
    named tuple, as the package's other records, not a dataclass, whose methods are
    compiled when its module loads, on the way to a training script's first item.

    Nodes are indices into ``graph.datapipes``; node 0 is the output.

    Attributes:
        graph: the discovered graph.
        num_workers: the number of worker processes planned for.
        segments: the segment of every node, by index.
        dispatchers: the nodes whose items travel from the dispatch process to the workers.
        worker_outputs: the nodes whose items travel from the workers to the main
            process (or the output itself when it runs in the workers). Either this or
            ``dispatchers`` may hold several nodes: each worker then runs one lane per
            worker output, and the dispatch process one per dispatcher, each with its
            own channels.
        sharding_points: worker-segment nodes with ``apply_sharding``, such as
            ``sharding_filter``.
        warnings: footguns found, such as no sharding point; the reading service issues
            them as ``UserWarning`` and ``explain()`` shows them.
        delivery: how items reach the loop when the service does more than hand them
            over (``pin_memory``, ``device``); set by the reading service, None otherwise.
    """

    graph: Graph
    num_workers: int
    segments: tuple[Segment, ...]
    dispatchers: tuple[int, ...]
    worker_outputs: tuple[int, ...]
    sharding_points: tuple[int, ...]
    warnings: tuple[str, ...]
    delivery: str | None = None

    @property
    def uses_processes(self) -> bool:
        return self.num_workers > 0 and bool(self.worker_outputs)

    def segment_of(self, datapipe: Any) -> Segment:
        """The segment of a DataPipe of the planned graph (by identity)."""
        for index, candidate in enumerate(self.graph.datapipes):
            if candidate is datapipe:
                return self.segments[index]
        raise KeyError(f"{type(datapipe).__name__} is not part of this plan's graph")

    def nodes_in(self, segment: Segment) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.segments) if s is segment)

    def held_in_main(self) -> tuple[tuple[int, int], ...]:
        """``(stage, blocker)`` pairs: each DataPipe that runs a function of the user's per
        item (map, filter, flatmap...) in the main process only because it comes after
        ``blocker``, a DataPipe of torchdata's that is not replicable (``fullsync()``,
        ``pin_memory()``); placed before it, the workers would run it. After a DataPipe of
        the user's own that says it is not replicable, the main process is where the user
        put it, and nothing is reported."""
        if not self.uses_processes:
            return ()
        return _held_in_main(self.graph, self.segments)

    def explain(self) -> str:
        """A text rendering: one section per process with its nodes, the queues between
        processes, the worker replica count, the sharding points and the warnings."""
        from .explain import explain_text

        return explain_text(self)

    def to_dot(self) -> str:
        """The same as ``explain()`` as Graphviz DOT text: one cluster per process kind,
        queues as dashed edges. Needs nothing to produce; any Graphviz viewer draws it."""
        from .explain import explain_dot

        return explain_dot(self)

    def render(self, format: str = "svg") -> bytes:
        """``to_dot()`` drawn as ``"svg"`` or ``"png"`` bytes.

        Needs the optional ``graphviz`` package and Graphviz's ``dot`` program, and raises
        ``GraphvizNotFound`` saying what is missing. The only method of a Plan that does
        I/O: it runs ``dot``.
        """
        from .explain import render_dot

        return render_dot(self.to_dot(), format)


def plan(datapipe: Any, num_workers: int) -> Plan:
    """Plan ``datapipe`` for ``num_workers`` worker processes (0: everything in-process).

    Pure: nothing is iterated, no process starts, so a pipeline can be checked (and
    drawn with ``Plan.explain()``) before it runs. The reading service calls it once,
    when ``DataLoader2`` first iterates.

    Args:
        datapipe: the pipeline's last DataPipe (the one a loader iterates), or a ``NoGraph``
            around it.
        num_workers: the worker processes to plan for; 0 plans everything in the calling
            process.

    Raises:
        AmbiguousGraphError: a DataPipe holds references whose targets would run in
            different processes; the message names the attribute and the fixes.
        PlanError: a DataPipe refers to one downstream of it (a cycle); the message names
            the attribute. A DataPipe that refers to itself is fine, as with torch.
        ValueError: ``num_workers`` is not an int >= 0.
        TypeError: ``datapipe`` is not a DataPipe, or a ``get_parents()`` returned
            something that is not one.
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
    if isinstance(datapipe, NoGraph):
        datapipe = datapipe.target
    graph = discover(datapipe)
    _check_acyclic(graph)
    if num_workers == 0:
        return Plan(graph, 0, (Segment.MAIN,) * len(graph.nodes), (), (), (), ())
    segments = _assign_segments(graph)
    _check_references(graph, segments)
    dispatchers = _boundary_dispatchers(graph, segments)
    worker_outputs = _worker_outputs(graph, segments)
    sharding_points = tuple(
        i for i, dp in enumerate(graph.datapipes) if segments[i] is Segment.WORKER and _is_sharding(dp)
    )
    warnings = _footguns(graph, segments, num_workers, dispatchers, worker_outputs, sharding_points)
    return Plan(graph, num_workers, segments, dispatchers, worker_outputs, sharding_points, warnings)


def _check_acyclic(graph: Graph) -> None:
    """Raise ``PlanError`` naming the reference that closes a cycle (a DataPipe upstream
    holding one downstream), which no split into processes can run."""
    state: dict[int, bool] = {}  # False: on the current path; True: done
    for root in range(len(graph.nodes)):
        if root in state:
            continue
        state[root] = False
        stack = [(root, iter(graph.nodes[root].edges))]
        while stack:
            index, edges = stack[-1]
            edge = next(edges, None)
            if edge is None:
                state[index] = True
                stack.pop()
                continue
            if state.get(edge.parent) is False:
                node, target = graph.nodes[index], graph.nodes[edge.parent]
                raise PlanError(
                    f"{node.name}.{edge.path} points at {target.name}, which is downstream of {node.name}: "
                    f"the references form a cycle, which cannot be split into processes. Wrap "
                    f"{node.name}.{edge.path.split('[', 1)[0]} in NoGraph(...) if {node.name} does not iterate it, "
                    f"or define {node.name}.get_parents() returning only its real inputs."
                )
            if edge.parent not in state:
                state[edge.parent] = False
                stack.append((edge.parent, iter(graph.nodes[edge.parent].edges)))


# torchdata's dispatcher, looked up where it is loaded: a graph without torchdata's
# DataPipes (``mprs_plus.DataLoader``'s) is planned without importing torchdata, whose
# DataPipes print a deprecation banner when first imported.
_DISPATCHER_MODULE = "torchdata.datapipes.iter.util.sharding"


def _is_dispatcher(datapipe: Any) -> bool:
    module = sys.modules.get(_DISPATCHER_MODULE)
    return module is not None and isinstance(datapipe, module.ShardingRoundRobinDispatcherIterDataPipe)


def _is_sharding(datapipe: Any) -> bool:
    return callable(getattr(datapipe, "apply_sharding", None)) and not _is_dispatcher(datapipe)


def _boundary_dispatchers(graph: Graph, segments: tuple[Segment, ...]) -> tuple[int, ...]:
    """Dispatchers whose items leave the dispatch process (one nested inside the dispatch
    segment just passes its items on, in that process)."""
    children = graph.children()
    return tuple(
        i
        for i, dp in enumerate(graph.datapipes)
        if _is_dispatcher(dp)
        and (i == graph.output or any(segments[child] is not Segment.DISPATCH for child in children[i]))
    )


def _is_replicable(datapipe: Any) -> bool:
    method = getattr(datapipe, "is_replicable", None)
    return bool(method()) if callable(method) else True


def _assign_segments(graph: Graph) -> tuple[Segment, ...]:
    segments: dict[int, Segment] = {}
    for index, dp in enumerate(graph.datapipes):
        if _is_dispatcher(dp):
            segments[index] = Segment.DISPATCH
            for ancestor in graph.ancestors(index):
                segments[ancestor] = Segment.DISPATCH
    for index in graph.topological():
        if index in segments:
            continue
        node = graph.nodes[index]
        downstream_of_main = any(segments[p] is Segment.MAIN for p in node.parents)
        if downstream_of_main or not _is_replicable(graph.datapipes[index]):
            segments[index] = Segment.MAIN
        else:
            segments[index] = Segment.WORKER
    return tuple(segments[i] for i in range(len(graph.nodes)))


def _where(segment: Segment) -> str:
    return {
        Segment.DISPATCH: "the dispatch process",
        Segment.WORKER: "the worker processes",
        Segment.MAIN: "the main process",
    }[segment]


def _check_references(graph: Graph, segments: tuple[Segment, ...]) -> None:
    ancestors = {i: graph.ancestors(i) for i in range(len(graph.nodes))}
    for node in graph.nodes:
        for edge in node.edges:
            side_of = _side_reference_of(node, edge, ancestors)
            if side_of is not None and segments[edge.parent] is not segments[side_of.parent]:
                raise AmbiguousGraphError(_straddle_message(graph, segments, node, edge, side_of))
        for edge in node.edges:
            parent = edge.parent
            crosses_out_of_dispatch = (
                segments[parent] is Segment.DISPATCH
                and segments[node.index] is not Segment.DISPATCH
                and not _is_dispatcher(graph.datapipes[parent])
            )
            if crosses_out_of_dispatch:
                raise AmbiguousGraphError(
                    f"{node.name}.{edge.path} reads {graph.nodes[parent].name}, which runs in the dispatch "
                    f"process (it feeds sharding_round_robin_dispatch), while {node.name} runs in "
                    f"{_where(segments[node.index])}. A DataPipe runs in one process only: read the data "
                    f"after the dispatcher, wrap {edge.path} in NoGraph(...) if {node.name} does not iterate "
                    f"it, or define {node.name}.get_parents() to list its real inputs."
                )


def _side_reference_of(node: Node, edge: Edge, ancestors: dict[int, set[int]]) -> Edge | None:
    """The other edge of ``node`` whose target lies downstream of ``edge``'s target, if any."""
    for other in node.edges:
        if other.parent != edge.parent and edge.parent in ancestors[other.parent]:
            return other
    return None


def _straddle_message(graph: Graph, segments: tuple[Segment, ...], node: Node, side: Edge, main: Edge) -> str:
    attribute = side.path.split("[", 1)[0].split(".", 1)[0]
    return (
        f"{node.name}.{side.path} ({segments[side.parent].value}) and {node.name}.{main.path} "
        f"({segments[main.parent].value}) straddle segments: {node.name}.{side.path} points at "
        f"{graph.nodes[side.parent].name}, which is also upstream of {node.name}.{main.path}, so the "
        f"graph cannot tell which one {node.name} reads. Wrap {attribute} in NoGraph(...) or define "
        f"{node.name}.get_parents() returning only the DataPipes it iterates."
    )


def _worker_outputs(graph: Graph, segments: tuple[Segment, ...]) -> tuple[int, ...]:
    outputs: list[int] = []
    for node in graph.nodes:
        if segments[node.index] is not Segment.MAIN:
            continue
        for parent in node.parents:
            crosses = segments[parent] is Segment.WORKER or (
                segments[parent] is Segment.DISPATCH and _is_dispatcher(graph.datapipes[parent])
            )
            if crosses and parent not in outputs:
                outputs.append(parent)
    if segments[graph.output] is not Segment.MAIN and graph.output not in outputs:
        outputs.append(graph.output)
    return tuple(outputs)


def _does_work_per_item(datapipe: Any) -> bool:
    """Whether a DataPipe runs a function of the user's on every item: the stages a user
    means to spread over the workers. Collating stays out: it belongs where batches end."""
    if isinstance(datapipe, CollatorIterDataPipe):
        return False
    return any(callable(getattr(datapipe, name, None)) for name in ("fn", "filter_fn"))


def _held_in_main(graph: Graph, segments: tuple[Segment, ...]) -> tuple[tuple[int, int], ...]:
    found = []
    for index in graph.topological():
        dp = graph.datapipes[index]
        if segments[index] is not Segment.MAIN or not _is_replicable(dp) or not _does_work_per_item(dp):
            continue
        # The nearest non-replicable DataPipe upstream: the one that keeps this stage in main.
        blockers = [i for i in graph.ancestors(index) if not _is_replicable(graph.datapipes[i])]
        nearest = min(blockers, key=lambda i: len(graph.ancestors(index) - graph.ancestors(i)), default=None)
        if nearest is not None and not _declared_by_user(graph.datapipes[nearest]):
            found.append((index, nearest))
    return tuple(found)


def _declared_by_user(datapipe: Any) -> bool:
    """Whether a DataPipe's own class (the user's) says it is not replicable: where the main
    process begins is then the user's decision, as the graph rules describe. torchdata's
    fullsync() and pin_memory() are not replicable for reasons of their own, and what
    follows them lands in the main process unnoticed: that is what the planner warns of."""
    method = getattr(type(datapipe), "is_replicable", None)
    module = getattr(method, "__module__", "") or ""
    return not module.startswith(("torch.", "torchdata."))


def _functional_call(datapipe: Any) -> str:
    """How a pipeline names a DataPipe when it is built: ``.map(square)`` for a Mapper,
    else its class name."""
    label = describe(datapipe)
    for name, function in IterDataPipe.functions.items():
        if isinstance(function, functools.partial) and function.args and function.args[0] is type(datapipe):
            inner = label[len(type(datapipe).__name__):]
            return f".{name}{inner or '()'}"
    return label


def _held_in_main_warning(graph: Graph, stages: list[int], blocker: int) -> str:
    names = ", ".join(f"#{i} {_functional_call(graph.datapipes[i])}" for i in stages)
    blocked = f"#{blocker} {_functional_call(graph.datapipes[blocker])}"
    one = len(stages) == 1
    return (
        f"{names} run{'s' if one else ''} in the main process, next to the training loop, one item at a time: "
        f"{'it comes' if one else 'they come'} after {blocked}, which is not replicable, and everything after a "
        f"non-replicable DataPipe runs in the main process. Move {'it' if one else 'them'} before {blocked} so that "
        f"the workers run {'it' if one else 'them'} in parallel (the main process should only do what must happen "
        "there)."
    )


def _footguns(
    graph: Graph,
    segments: tuple[Segment, ...],
    num_workers: int,
    dispatchers: tuple[int, ...],
    worker_outputs: tuple[int, ...],
    sharding_points: tuple[int, ...],
) -> tuple[str, ...]:
    found: list[str] = []
    if Segment.WORKER not in segments:
        first_main = next((i for i in graph.topological() if segments[i] is Segment.MAIN), None)
        where = f" ({graph.nodes[first_main].name} is not replicable)" if first_main is not None else ""
        consequence = (
            "the workers only pass the dispatched items on, and all the work runs in the dispatch and main processes"
            if dispatchers
            else "the work stays in the main process"
        )
        found.append(
            f"The worker segment is empty: no DataPipe runs in the {num_workers} worker processes, so "
            f"{consequence}{where}. Move non-replicable steps after the expensive ones, or mark the split with "
            "sharding_filter() / sharding_round_robin_dispatch(...)."
        )
    elif num_workers > 1 and not dispatchers and not sharding_points:
        found.append(
            f"No sharding point: with num_workers={num_workers} every worker yields the whole dataset, "
            f"so each item arrives {num_workers} times. Add .sharding_filter() after the source, or "
            ".sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING) where items should be "
            "handed out."
        )
    elif num_workers > 1 and len(worker_outputs) > 1:
        for output in worker_outputs:
            upstream = graph.ancestors(output) | {output}
            if not upstream & (set(dispatchers) | set(sharding_points)):
                found.append(
                    f"No sharding point on the branch ending at #{output} {graph.nodes[output].name}: with "
                    f"num_workers={num_workers} every worker yields all of its items, so each arrives "
                    f"{num_workers} times. Add .sharding_filter() after that branch's source."
                )
    if Segment.WORKER in segments:  # with an empty worker segment, the warning above says it all
        by_blocker: dict[int, list[int]] = {}
        for stage, blocker in _held_in_main(graph, segments):
            by_blocker.setdefault(blocker, []).append(stage)
        found += [_held_in_main_warning(graph, stages, blocker) for blocker, stages in by_blocker.items()]
    return tuple(found)
