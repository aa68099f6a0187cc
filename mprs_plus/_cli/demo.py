"""``demo``: a pipeline that torchdata silently ran in one process, split as written.

The ``Wrapper`` keeps its source in ``NoGraph``; each stage stamps the id of the
process it ran in onto the item, so the split is visible item by item.
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any

from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper, IterDataPipe

from ..graph import NoGraph
from ..reading_service import MultiProcessingReadingService
from ..segment import Segment

STAGES = ("Pre Main", "Worker", "Post Main")


def stamp(item: Any, stage: str) -> Any:
    value, pids = item if isinstance(item, tuple) else (item, {})
    return value, {**pids, stage: os.getpid()}


class NonReplicable(IterDataPipe):
    """Marks the end of the worker segment: everything after it runs in the main process."""

    def __init__(self, dp: IterDataPipe) -> None:
        self.dp = dp

    def __iter__(self) -> Any:
        return iter(self.dp)

    def is_replicable(self) -> bool:
        return False


def create_pipe(src: Any) -> IterDataPipe:
    pipe = src.map(functools.partial(stamp, stage="Pre Main"))
    pipe = pipe.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    pipe = pipe.map(functools.partial(stamp, stage="Worker"))
    pipe = NonReplicable(pipe)
    return pipe.map(functools.partial(stamp, stage="Post Main"))


class Wrapper(IterDataPipe):
    """The seed's wrapper: it keeps its source besides the pipeline built on it."""

    def __init__(self, n: int) -> None:
        self.src = NoGraph(IterableWrapper(range(n)))
        self.dp = create_pipe(self.src)

    def __iter__(self) -> Any:
        return iter(self.dp)


_WHAT_IT_RUNS = """\
The demo's pipeline (mprs_plus/_cli/demo.py), from the source to the loop:
  IterableWrapper  the source: the numbers 0 to {last}
  map "Pre Main"   before sharding_round_robin_dispatch: runs once, in the dispatch process
  map "Worker"     after it: each worker runs it on the items dealt to that worker
  NonReplicable    a DataPipe of the demo whose is_replicable() returns False: from here on,
                   the main process runs the pipeline
  map "Post Main"  after it: runs in the main process
  Wrapper          the outer DataPipe. It keeps a reference to the source besides the pipeline
                   built on it, which makes torchdata's own reading service run everything in
                   one process; here that reference is wrapped in NoGraph(...), so the
                   pipeline is split as written.
Each map writes the id of the process it ran in onto the item. Where each DataPipe runs,
as planned before anything ran (#0 is the output):
"""


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "demo",
        help="run a small three-stage pipeline and show which process ran each stage",
        description="Run a small pipeline whose three stages belong in the dispatch process, the worker "
        "processes and the main process; print the plan, which process ran each stage for each item, "
        "and whether each stage ran where it was planned (exit code 1 if not).",
    )
    parser.add_argument("--num-workers", type=int, default=2, metavar="N", help="worker processes (default 2)")
    parser.add_argument("--items", type=int, default=6, metavar="N", help="items the source yields (default 6)")
    parser.add_argument(
        "--context", default=None, help="multiprocessing start method: fork, spawn or forkserver (default: the platform's)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    service = MultiProcessingReadingService(args.num_workers, multiprocessing_context=args.context)
    loader = DataLoader2(Wrapper(args.items), reading_service=service)
    try:
        rows = list(loader)
        plan = loader.reading_service.plan
        print(_WHAT_IT_RUNS.format(last=args.items - 1))
        print(plan.explain())
    finally:
        loader.shutdown()
    print()
    print(f"main process: pid {os.getpid()}")
    print(f"{'item':>4}  " + "  ".join(f"{stage:>10}" for stage in STAGES))
    for value, pids in rows:
        print(f"{value:>4}  " + "  ".join(f"{pids[stage]:>10}" for stage in STAGES))
    print()
    verdicts = where_each_stage_ran(rows, os.getpid(), planned_segments(plan), min(args.num_workers, args.items))
    for line, _ in verdicts:
        print(line)
    return 0 if all(as_planned for _, as_planned in verdicts) else 1


def planned_segments(plan: Any) -> dict[str, Segment]:
    """The segment the plan gave each stamping stage."""
    found = {}
    for index, datapipe in enumerate(plan.graph.datapipes):
        fn = getattr(datapipe, "fn", None)
        if isinstance(fn, functools.partial) and fn.func is stamp:
            found[fn.keywords["stage"]] = plan.segments[index]
    return found


def where_each_stage_ran(
    rows: list[Any], main_pid: int, planned: dict[str, Segment], workers: int
) -> list[tuple[str, bool]]:
    """A line per stage saying where it ran and whether that is where the plan put it: the
    dispatch process is one process of its own, the workers are ``workers`` processes, and
    neither is the main process."""
    seen = {stage: sorted({pids[stage] for _, pids in rows}) for stage in STAGES}
    by_segment = {segment: {pid for stage in STAGES if planned[stage] is segment for pid in seen[stage]} for segment in Segment}
    found = []
    for stage in STAGES:
        segment, pids = planned[stage], set(seen[stage])
        if segment is Segment.MAIN:
            name, as_planned = "the main process", pids == {main_pid}
        elif segment is Segment.DISPATCH:
            others = by_segment[Segment.WORKER] | {main_pid}
            name, as_planned = "the dispatch process", len(pids) == 1 and not pids & others
        else:
            others = by_segment[Segment.DISPATCH] | {main_pid}
            name, as_planned = f"the {workers} worker processes", len(pids) == workers and not pids & others
        where = f"process{'es' if len(pids) != 1 else ''} {', '.join(map(str, seen[stage]))}"
        if as_planned:
            found.append((f"{stage} ran in {name} ({where}), as planned.", True))
        else:
            found.append((f"{stage} ran in {where}: NOT where planned, which is {name}.", False))
    return found
