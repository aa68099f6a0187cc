"""Time to first item and shutdown time, in seconds (lower is better).

    t0: create the loader -> iter -> first item: t1 -> shutdown() returns: t2

The loader is shut down right after its first item, with the workers still busy (a
``break`` out of the training loop), so shutdown must stop producers mid-epoch.
"""

from __future__ import annotations

import functools
import statistics
import time

from .. import harness
from ._shared import ShardedRange, identity, mapped_range

ITEMS = 1_000_000  # far more than any loader prefetches: the workers are busy at shutdown
TRIALS = 3  # per repetition: start-up is quick, and its noise large


def run(contender: str, settings: harness.Settings) -> dict[str, object]:
    """A few loaders one after another (one with --quick); the medians, and every trial."""
    trials = [_trial(contender, settings) for _ in range(1 if settings.quick else TRIALS)]
    return {
        "first_item": statistics.median(t["first_item"] for t in trials),
        "shutdown": statistics.median(t["shutdown"] for t in trials),
        "trials": trials,
    }


def _trial(contender: str, settings: harness.Settings) -> dict[str, float]:
    clock = time.perf_counter
    start = clock()
    loader = harness.open_loader(
        contender, settings, pipe=mapped_range(ITEMS, identity), dataset=ShardedRange(ITEMS, identity)
    )
    try:
        next(iter(loader))
        first = clock()
    except BaseException:
        harness.close_within(loader, settings)
        raise
    with harness.deadline(settings.shutdown_limit_s, "shutdown"):
        loader.close()
    return {"first_item": first - start, "shutdown": clock() - first}


WORKLOAD = harness.Workload(
    name="startup_shutdown",
    title="start-up / shutdown",
    description="create the loader -> first item; then shutdown() with the workers still busy; seconds",
    metrics=(
        harness.Metric("first_item", "s", higher_is_better=False),
        harness.Metric("shutdown", "s", higher_is_better=False),
    ),
    runners={c: functools.partial(run, c) for c in (harness.MPRS_PLUS, harness.TORCHDATA, harness.TORCH)},
    targets=(
        harness.Target("first_item", harness.TORCHDATA, 1.0),
        # At most 1.2 times torch's DataLoader: the ratio (torch's time over ours) >= 1/1.2.
        harness.Target("first_item", harness.TORCH, 1 / 1.2),
        harness.Target("shutdown", harness.TORCHDATA, 1.0),
    ),
    notes={harness.IN_PROCESS: "nothing to start or stop"},
)
