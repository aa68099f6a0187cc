"""A pipeline with a dispatch process: ``sharding_round_robin_dispatch`` feeding CPU work
in the workers, in items/s.

    range(n) --[dispatch process]--> round-robin --> worker w: burn ~2 ms --> main

Measures the extra hop (dispatch -> worker -> main) on top of the CPU-bound case.
"""

from __future__ import annotations

import functools
from typing import Any

from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.datapipes.iter import IterableWrapper

from .. import harness
from ._shared import burn


def make_pipe(n: int, loops: int) -> Any:
    pipe = IterableWrapper(range(n)).sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    return pipe.map(functools.partial(burn, loops=loops))


def run(contender: str, settings: harness.Settings) -> dict[str, float]:
    n = 100 if settings.quick else 1500
    return harness.stream(
        lambda: harness.open_loader(contender, settings, pipe=make_pipe(n, settings.cpu_loops)),
        items=n,
        settings=settings,
    )


WORKLOAD = harness.Workload(
    name="dispatch_pipeline",
    title="dispatch + CPU work",
    description="range -> sharding_round_robin_dispatch (dispatch process) -> ~2 ms Python work in the workers; items/s",
    metrics=(harness.Metric("throughput", "items/s"),),
    runners={c: functools.partial(run, c) for c in (harness.MPRS_PLUS, harness.TORCHDATA, harness.IN_PROCESS)},
    targets=(harness.Target("throughput", harness.IN_PROCESS, 1.8),),
    notes={
        harness.TORCH: "torch's DataLoader has no dispatch process",
        harness.SPDL: "iterate_in_subprocess runs one iterable in one subprocess: no dispatch process",
    },
)
