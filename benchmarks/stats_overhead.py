"""What collecting live statistics costs: tiny items with ``collect_stats`` on and off.

Tiny items are the worst case: the per-item work is nothing, so the few clock reads per
item that statistics add are the largest share they can be. Runs interleaved (on, off, on,
off, ...) and prints medians::

    python benchmarks/stats_overhead.py [--items 400000] [--repetitions 5] [--workers 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore", message=r"\s*#+\s*WARNING!")

from torchdata.dataloader2 import DataLoader2  # noqa: E402
from torchdata.datapipes.iter import IterableWrapper  # noqa: E402

from mprs_plus import MultiProcessingReadingService  # noqa: E402


def identity(x: int) -> int:
    return x


def rate(collect: bool, items: int, workers: int) -> float:
    pipe = IterableWrapper(range(items)).sharding_filter().map(identity)
    loader = DataLoader2(pipe, reading_service=MultiProcessingReadingService(workers, collect_stats=collect))
    try:
        next(iter(loader))  # start the processes, untimed
        started = time.perf_counter()
        count = sum(1 for _ in loader)
        return count / (time.perf_counter() - started)
    finally:
        loader.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=400_000)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    rates: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repetitions):
        for collect in (True, False):
            rates[collect].append(rate(collect, args.items, args.workers))
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    print(f"tiny items, {args.workers} workers, medians of {args.repetitions}:")
    print(f"  collect_stats=True   {on:>10,.0f} items/s")
    print(f"  collect_stats=False  {off:>10,.0f} items/s")
    print(f"  overhead             {1 - on / off:>10.1%}")


if __name__ == "__main__":
    main()
