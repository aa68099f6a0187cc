"""Turn a Plan into runnable copies of its segments, without touching the user's objects.

The dispatch and worker segments are deep-copied with the boundary nodes swapped for
stand-ins through ``copy.deepcopy``'s memo: every dispatcher becomes a ``DispatchedInput``
in the workers' copy. The copies are built once, in the main process; children receive
them. The main segment is the planned graph itself, with a reader of worker channels
spliced in for every worker output (see ``build_main_pipeline``).

A segment may have several outputs (worker outputs joined in the main process by a
non-replicable DataPipe; several dispatchers). Outputs whose upstream DataPipes overlap
form a *group*: their lanes share a compute lock in the child (see ``lanes.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from torch.utils.data import IterDataPipe, MapDataPipe

from ..explain import describe
from ..graph import NoGraph, discover
from ..plan import Plan, Segment
from .worker import DispatchedInput, WorkerProgram


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
    return WorkerProgram(tuple(outputs_copy), tuple(placeholders.values()), tuple(roots_copy), groups)


def build_dispatch_sources(plan: Plan) -> tuple[tuple[Any, ...], tuple[int, ...]] | None:
    """Copies of the dispatchers (one deep copy, so shared upstream stays shared) and their groups."""
    if not plan.dispatchers:
        return None
    sources = copy.deepcopy([plan.graph.datapipes[i] for i in plan.dispatchers])
    return tuple(sources), _groups(plan, plan.dispatchers, Segment.DISPATCH)


def build_main_pipeline(plan: Plan, readers: Sequence[Any]) -> Any:
    """The main segment, reading worker output ``plan.worker_outputs[k]`` through ``readers[k]``.

    Unlike the other segments, the main one is the planned graph itself, with the readers
    spliced in where its nodes referred to worker outputs: that graph is DataLoader2's own
    copy, and a service chained before this one (DistributedReadingService) keeps it and
    seeds it every epoch. Once spliced, it reaches only the main segment, as with torchdata,
    so it draws the same seeds as with torchdata. Call it after the other segments are
    copied. Should a reference hide where splicing cannot reach, the main segment is a deep
    copy instead (then the seeds such a service draws may differ from torchdata's).
    """
    graph = plan.graph
    stand_ins = {id(graph.datapipes[i]): reader for i, reader in zip(plan.worker_outputs, readers)}
    output = graph.datapipes[graph.output]
    if id(output) in stand_ins:
        return stand_ins[id(output)]
    for index in plan.nodes_in(Segment.MAIN):
        node = graph.datapipes[index]
        state = getattr(node, "__dict__", None)
        if state is None:
            continue
        for name, value in list(state.items()):
            replaced, changed = _splice(value, stand_ins, depth=0)
            if changed:
                state[name] = replaced
    main_nodes = {id(graph.datapipes[i]) for i in plan.nodes_in(Segment.MAIN)}
    readers_by_id = {id(reader) for reader in readers}
    if all(id(dp) in main_nodes or id(dp) in readers_by_id for dp in discover(output).datapipes):
        return output
    return copy.deepcopy(output, dict(stand_ins))


_MAX_DEPTH = 8  # as deep as graph discovery looks


def _splice(value: Any, stand_ins: dict[int, Any], depth: int) -> tuple[Any, bool]:
    """``value`` with every reference to a key of ``stand_ins`` replaced; lists, dicts and
    NoGraph proxies are changed in place, tuples and sets rebuilt (then ``changed``)."""
    if id(value) in stand_ins:
        return stand_ins[id(value)], True
    if isinstance(value, NoGraph):
        target, changed = _splice(value.target, stand_ins, depth + 1)
        if changed:
            object.__setattr__(value, "_target", target)
        return value, False
    if depth >= _MAX_DEPTH or isinstance(value, (IterDataPipe, MapDataPipe, str, bytes)):
        return value, False
    if isinstance(value, list):
        for i, item in enumerate(value):
            replaced, changed = _splice(item, stand_ins, depth + 1)
            if changed:
                value[i] = replaced
        return value, False
    if isinstance(value, dict):
        for key, item in list(value.items()):
            replaced, changed = _splice(item, stand_ins, depth + 1)
            if changed:
                value[key] = replaced
        return value, False
    if isinstance(value, (tuple, set, frozenset)):
        items = [_splice(item, stand_ins, depth + 1) for item in value]
        if not any(changed for _, changed in items):
            return value, False
        rebuilt = [item for item, _ in items]
        if isinstance(value, tuple) and hasattr(value, "_make"):  # a namedtuple
            return value._make(rebuilt), True  # type: ignore[attr-defined]
        return type(value)(rebuilt), True
    return value, False


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
