"""``demo``: the pipeline that torchdata silently ran in one process, split as written.

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


def register(commands: Any) -> None:
    parser = commands.add_parser("demo", help="run the seed pipeline and show where each stage ran")
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
        print(loader.reading_service.plan.explain())
    finally:
        loader.shutdown()
    print()
    print(f"main process: pid {os.getpid()}")
    print(f"{'item':>4}  " + "  ".join(f"{stage:>10}" for stage in STAGES))
    for value, pids in rows:
        print(f"{value:>4}  " + "  ".join(f"{pids[stage]:>10}" for stage in STAGES))
    seen = {stage: sorted({pids[stage] for _, pids in rows}) for stage in STAGES}
    print()
    for stage, role in zip(STAGES, ("dispatch process", "worker processes", "main process")):
        print(f"{stage:>9} ran in {len(seen[stage])} process(es) {seen[stage]}: expected the {role}")
    return 0
