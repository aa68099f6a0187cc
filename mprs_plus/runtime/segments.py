"""Turn a Plan into runnable copies of its segments, without touching the user's objects.

Each segment is deep-copied with the boundary nodes swapped for stand-ins through
``copy.deepcopy``'s memo: every dispatcher becomes a ``DispatchedInput`` in the workers'
copy, and every worker output becomes a main-process reader of worker channels in the
main copy. The copies are built once, in the main process; children receive them.

A segment may have several outputs (worker outputs joined in the main process by a
non-replicable DataPipe; several dispatchers). Outputs whose upstream DataPipes overlap
form a *group*: their lanes share a compute lock in the child (see ``lanes.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from ..explain import describe
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
    """The main segment, reading worker output ``plan.worker_outputs[k]`` through ``readers[k]``."""
    graph = plan.graph
    stand_ins = dict(zip(plan.worker_outputs, readers))
    if graph.output in stand_ins:
        return stand_ins[graph.output]
    memo = {id(graph.datapipes[i]): reader for i, reader in stand_ins.items()}
    return copy.deepcopy(graph.datapipes[graph.output], memo)


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
