"""Turn a Plan into runnable copies of its segments, without touching the user's objects.

Each segment is deep-copied with the boundary nodes swapped for stand-ins through
``copy.deepcopy``'s memo: a dispatcher becomes a ``DispatchedInput`` in the workers'
copy, and the worker output becomes the main process's reader of worker channels in
the main copy. The copies are built once, in the main process; children receive them.
"""

from __future__ import annotations

import copy
from typing import Any

from ..errors import PlanError
from ..explain import describe
from ..plan import Plan, Segment
from .worker import DispatchedInput, WorkerProgram


def _single(plan: Plan, indices: tuple[int, ...], what: str) -> int:
    if len(indices) != 1:
        names = ", ".join(f"#{i} {plan.graph.nodes[i].name}" for i in indices)
        raise PlanError(
            f"this graph has {len(indices)} {what} ({names}); one is supported. "
            "Join the branches with a replicable DataPipe (zip, mux, concat) before the first "
            "non-replicable one, so that they run as one worker segment."
        )
    return indices[0]


def worker_output(plan: Plan) -> int:
    return _single(plan, plan.worker_outputs, "branches leaving the worker processes")


def dispatcher(plan: Plan) -> int | None:
    if not plan.dispatchers:
        return None
    return _single(plan, plan.dispatchers, "sharding_round_robin_dispatch points")


def build_worker_program(plan: Plan) -> WorkerProgram:
    graph = plan.graph
    output = worker_output(plan)
    dispatched = dispatcher(plan)
    placeholders: dict[int, DispatchedInput] = {}
    if dispatched is not None:
        placeholders[dispatched] = DispatchedInput(describe(graph.datapipes[dispatched]))
    memo: dict[int, Any] = {id(graph.datapipes[i]): stand_in for i, stand_in in placeholders.items()}
    roots = [graph.datapipes[i] for i in _sharding_roots(plan, output)]
    output_copy, roots_copy = copy.deepcopy((graph.datapipes[output], roots), memo)
    return WorkerProgram(output_copy, tuple(placeholders.values()), tuple(roots_copy))


def build_dispatch_source(plan: Plan) -> Any | None:
    dispatched = dispatcher(plan)
    return None if dispatched is None else copy.deepcopy(plan.graph.datapipes[dispatched])


def build_main_pipeline(plan: Plan, worker_reader: Any) -> Any:
    """The main segment, reading the workers' output through ``worker_reader``."""
    output = worker_output(plan)
    if output == plan.graph.output:
        return worker_reader
    return copy.deepcopy(plan.graph.datapipes[plan.graph.output], {id(plan.graph.datapipes[output]): worker_reader})


def _sharding_roots(plan: Plan, output: int) -> list[int]:
    """Worker-segment nodes to apply multiprocessing sharding to: the branches that are
    not fed by the dispatch process (those are already dealt out, item by item)."""
    graph = plan.graph
    fed = {i for i in range(len(graph.nodes)) if plan.segments[i] is Segment.DISPATCH}

    def fed_by_dispatch(index: int) -> bool:
        return index in fed or bool(graph.ancestors(index) & fed)

    if not fed_by_dispatch(output):
        return [output]
    roots: list[int] = []
    for index in [output, *graph.ancestors(output)]:
        if plan.segments[index] is not Segment.WORKER or not fed_by_dispatch(index):
            continue
        for parent in graph.nodes[index].parents:
            if plan.segments[parent] is Segment.WORKER and not fed_by_dispatch(parent) and parent not in roots:
                roots.append(parent)
    return roots
