"""Turn a Plan into runnable copies of its segments, without touching the user's objects.

The dispatch and worker segments are deep-copied with the boundary nodes swapped for
stand-ins through ``copy.deepcopy``'s memo: every dispatcher becomes a ``DispatchedInput``
in the workers' copy. The copies are built once, in the main process; children receive
them. The main segment is the planned graph's main-process nodes, with the graph walk's
recorded edges to worker outputs replayed onto readers of the worker channels (see
``build_main_pipeline``); nothing else of the user's graph changes.

A segment may have several outputs (worker outputs joined in the main process by a
non-replicable DataPipe; several dispatchers). Outputs whose upstream DataPipes overlap
form a *group*: their lanes share a compute lock in the child (see ``lanes.py``).
"""

from __future__ import annotations

import copy
import importlib
import pickle
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..errors import PlanError
from ..graph import describe, replace_reference
from ..segment import Segment
from .child.worker import DispatchedInput, WorkerProgram

if TYPE_CHECKING:
    from ..plan import Plan  # the plan is read, never built here: a child unpickling a segment needs none of it


def build_worker_program(plan: Plan) -> WorkerProgram:
    graph = plan.graph
    placeholders = {
        index: DispatchedInput(describe(graph.datapipes[index]), position)
        for position, index in enumerate(plan.dispatchers)
    }
    memo: dict[int, Any] = {id(graph.datapipes[i]): stand_in for i, stand_in in placeholders.items()}
    outputs = [graph.datapipes[i] for i in plan.worker_outputs]
    roots = [graph.datapipes[i] for i in _sharding_roots(plan)]
    outputs_copy, roots_copy = copy.deepcopy((outputs, roots), memo)
    groups = _groups(plan, plan.worker_outputs, Segment.WORKER)
    return PortableWorkerProgram(tuple(outputs_copy), tuple(placeholders.values()), tuple(roots_copy), groups)


def build_dispatch_sources(plan: Plan) -> tuple[tuple[Any, ...], tuple[int, ...]] | None:
    """Copies of the dispatchers (one deep copy, so shared upstream stays shared) and their groups."""
    if not plan.dispatchers:
        return None
    sources = copy.deepcopy([plan.graph.datapipes[i] for i in plan.dispatchers])
    return PortableSources(sources), _groups(plan, plan.dispatchers, Segment.DISPATCH)


def build_main_pipeline(plan: Plan, readers: Sequence[Any]) -> Any:
    """The main segment, reading worker output ``plan.worker_outputs[k]`` through ``readers[k]``.

    The main segment is the planned graph's own main-process nodes: each edge the graph
    walk recorded from one of them to a worker output is replayed to point at that
    output's reader instead. That graph is DataLoader2's private copy, and a service
    chained before this one (DistributedReadingService) keeps it and seeds it every
    epoch; once its edges are replayed it reaches only the main segment, as with
    torchdata, so it draws the same seeds as with torchdata.

    Only those edges change. No class changes, and nothing behind a ``NoGraph`` is
    touched: a ``NoGraph`` reference to a worker or dispatch node still reaches that
    node as built, with its attributes as set (the children run copies of it).
    """
    graph = plan.graph
    reader_of = dict(zip(plan.worker_outputs, readers))
    if graph.output in reader_of:
        return reader_of[graph.output]
    for index in plan.nodes_in(Segment.MAIN):
        owner = graph.datapipes[index]
        for edge in graph.nodes[index].edges:
            if edge.parent not in reader_of:
                continue
            parent = graph.datapipes[edge.parent]
            if not replace_reference(owner, edge.steps, parent, reader_of[edge.parent]):
                raise PlanError(
                    f"{graph.nodes[index].name}.get_parents() lists {graph.nodes[edge.parent].name}, which runs in "
                    f"the worker processes, but {graph.nodes[index].name} holds it nowhere in its attributes "
                    "(lists, tuples, dicts and sets included) where its reader could take its place. Keep "
                    "the DataPipes that get_parents() returns as plain attributes, not inside NoGraph(...)."
                )
    return graph.datapipes[graph.output]


# -- crossing into a spawned or forkserver child ----------------------------------------
#
# As torchdata does, a segment is pickled with pickle, and with dill when pickle cannot
# (a lambda, a local function) and dill is installed. Each segment is serialized as one
# piece, so DataPipes shared by several outputs stay shared in the child. Under fork
# nothing is pickled and none of this runs.


def _dill() -> ModuleType | None:
    try:
        return importlib.import_module("dill")
    except ImportError:
        return None


def dumps_segment(obj: Any) -> tuple[bytes, bool]:
    """``obj`` pickled, with dill if pickle fails and dill is installed; and whether dill was used.

    Raises pickle's error when neither can (then ``diagnose`` names the culprit)."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), False
    except Exception:
        dill = _dill()
        if dill is None:
            raise
        try:
            return dill.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), True
        except Exception:
            pass
        raise


def _loads_segment(data: bytes, used_dill: bool) -> Any:
    if used_dill:
        dill = _dill()
        if dill is None:
            raise ImportError("this segment was pickled with dill, which this process cannot import")
        return dill.loads(data)
    return pickle.loads(data)


class PortableWorkerProgram(WorkerProgram):
    """A ``WorkerProgram`` that crosses into a child as one blob (see ``dumps_segment``)
    and arrives as a plain ``WorkerProgram``."""

    __slots__ = ()

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        plain = WorkerProgram(*self)
        return _loads_segment, dumps_segment(plain)


class PortableSources(tuple):
    """The dispatch segment's copied dispatchers, crossing into the child as one blob and
    arriving as a plain tuple."""

    __slots__ = ()

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return _loads_segment, dumps_segment(tuple(self))


def for_cloudpickle(setup: Any) -> Any:
    """A child's setup (a named tuple) with its segments left to a pickler that ships the
    training script's own definitions by value, Ray's cloudpickle: pickle (and dill) would
    name a class of ``__main__`` by reference, which a process that is not a copy of the
    script (an actor on a node) cannot find."""
    plain = {
        name: WorkerProgram(*value) if isinstance(value, PortableWorkerProgram) else tuple(value)
        for name, value in setup._asdict().items()
        if isinstance(value, (PortableWorkerProgram, PortableSources))
    }
    return setup._replace(**plain) if plain else setup


def _groups(plan: Plan, outputs: Sequence[int], segment: Segment) -> tuple[int, ...]:
    """Group number of each output: outputs whose nodes in ``segment`` (or whose dispatched
    inputs) overlap share a group."""
    graph = plan.graph
    footprints = []
    for output in outputs:
        nodes = {output} | graph.ancestors(output)
        footprints.append(
            {i for i in nodes if plan.segments[i] is segment or (i in plan.dispatchers and i != output)}
            | {output}
        )
    group = list(range(len(outputs)))

    def find(k: int) -> int:
        while group[k] != k:
            k = group[k]
        return k

    for a in range(len(outputs)):
        for b in range(a + 1, len(outputs)):
            if footprints[a] & footprints[b]:
                group[find(b)] = find(a)
    return tuple(find(k) for k in range(len(outputs)))


def _sharding_roots(plan: Plan) -> list[int]:
    """Worker-segment nodes to apply multiprocessing sharding to: the branches that are
    not fed by the dispatch process (those are already dealt out, item by item)."""
    graph = plan.graph
    fed = {i for i in range(len(graph.nodes)) if plan.segments[i] is Segment.DISPATCH}

    def fed_by_dispatch(index: int) -> bool:
        return index in fed or bool(graph.ancestors(index) & fed)

    roots: list[int] = []
    for output in plan.worker_outputs:
        if not fed_by_dispatch(output):
            if output not in roots:
                roots.append(output)
            continue
        for index in [output, *graph.ancestors(output)]:
            if plan.segments[index] is not Segment.WORKER or not fed_by_dispatch(index):
                continue
            for parent in graph.nodes[index].parents:
                if plan.segments[parent] is Segment.WORKER and not fed_by_dispatch(parent) and parent not in roots:
                    roots.append(parent)
    return roots
