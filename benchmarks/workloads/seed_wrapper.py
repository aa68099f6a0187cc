"""The seed pipeline: a ``Wrapper`` DataPipe that keeps its source besides the pipeline built
on it, with ~2 ms of CPU work in the worker stage, in items/s.

    Wrapper.src -> map (dispatch) -> sharding_round_robin_dispatch -> map: burn (workers)
                -> NonReplicable -> map (main)

mprs_plus runs it with ``Wrapper.src`` in ``NoGraph``. torchdata runs the plain Wrapper, as
users wrote it: its reading service sees the side reference and runs the whole pipeline
in one process (the issue this project started from), which is what users got.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.datapipes.iter import IterableWrapper, IterDataPipe

from mprs_plus import NoGraph

from .. import harness
from ._shared import burn, identity


class NonReplicable(IterDataPipe):
    """Ends the worker stage: it and everything after it run in the main process."""

    def __init__(self, dp: IterDataPipe) -> None:
        self.dp = dp

    def __iter__(self) -> Iterator[Any]:
        return iter(self.dp)

    def is_replicable(self) -> bool:
        return False


def create_pipe(src: Any, loops: int) -> IterDataPipe:
    pipe = src.map(identity)
    pipe = pipe.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    pipe = pipe.map(functools.partial(burn, loops=loops))
    return NonReplicable(pipe).map(identity)


class Wrapper(IterDataPipe):
    """The seed's wrapper; ``hide_source`` keeps ``src`` out of the graph with ``NoGraph``."""

    def __init__(self, n: int, loops: int, hide_source: bool) -> None:
        src = IterableWrapper(range(n))
        self.src = NoGraph(src) if hide_source else src
        self.dp = create_pipe(self.src, loops)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.dp)


def run(contender: str, settings: harness.Settings) -> dict[str, float]:
    n = 100 if settings.quick else 1500
    hide_source = contender != harness.TORCHDATA
    return harness.stream(
        lambda: harness.open_loader(contender, settings, pipe=Wrapper(n, settings.cpu_loops, hide_source)),
        items=n,
        settings=settings,
    )


WORKLOAD = harness.Workload(
    name="seed_wrapper",
    title="seed Wrapper",
    description="the seed's Wrapper pipeline (dispatch, ~2 ms work in workers, non-replicable tail); items/s",
    metrics=(harness.Metric("throughput", "items/s"),),
    runners={c: functools.partial(run, c) for c in (harness.MPRS_PLUS, harness.TORCHDATA, harness.IN_PROCESS)},
    targets=(harness.Target("throughput", harness.IN_PROCESS, 1.8),),
    notes={
        harness.MPRS_PLUS: "Wrapper.src in NoGraph",
        harness.TORCHDATA: "plain Wrapper, as users wrote it: torchdata runs it in one process",
        harness.TORCH: "torch's DataLoader has no dispatch process or main-process tail",
        harness.SPDL: "a DataPipe graph split across processes; SPDL runs one iterable in one subprocess",
    },
)
