"""What restoring a mid-epoch checkpoint costs, against replaying the epoch through the loader.

For each point of the epoch (10%, 50%, 90% by default): take a checkpoint there, then time
from ``DataLoader2.from_state(...)`` to the first item it yields; and time a new loader with
the same seed from its creation to the same item, replaying every item before it through
the loader (what a job without checkpoints does to get back there without repeating
samples). Both include starting the processes. Runs interleaved and prints medians::

    python benchmarks/checkpoint.py [--items 2000] [--kib 1024] [--workers 2] [--repetitions 3]

Items are arrays of ``--kib`` KiB made by a cheap map, as decoded images are: a restored
worker computes its skipped items again but never sends them, so the saving is the
transport and the main-process side of the skipped items.
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

import numpy as np  # noqa: E402
from torchdata.dataloader2 import DataLoader2  # noqa: E402
from torchdata.datapipes.iter import IterableWrapper  # noqa: E402

from mprs_plus import MultiProcessingReadingService  # noqa: E402

_KIB = 1024


class MakeArray:
    """A picklable map: item i -> an array of ``kib`` KiB filled with i."""

    def __init__(self, kib: int) -> None:
        self.size = kib * _KIB // 4

    def __call__(self, i: int) -> np.ndarray:
        return np.full(self.size, i, dtype=np.float32)


def make_loader(items: int, kib: int, workers: int) -> DataLoader2:
    pipe = IterableWrapper(range(items)).shuffle().sharding_filter().map(MakeArray(kib))
    loader = DataLoader2(pipe, reading_service=MultiProcessingReadingService(workers))
    loader.seed(2024)
    return loader


def checkpoint_at(position: int, items: int, kib: int, workers: int) -> tuple[dict, float]:
    """The state after ``position`` items, and the first value of the item that follows."""
    loader = make_loader(items, kib, workers)
    try:
        iterator = iter(loader)
        for _ in range(position):
            next(iterator)
        state = loader.state_dict()
        following = float(next(iterator)[0])
    finally:
        loader.shutdown()
    return state, following


def time_restore(state: dict, workers: int, expected: float) -> float:
    started = time.perf_counter()
    loader = DataLoader2.from_state(state, MultiProcessingReadingService(workers))
    try:
        first = next(iter(loader))
        elapsed = time.perf_counter() - started
    finally:
        loader.shutdown()
    assert float(first[0]) == expected, "the restored loader did not resume where the checkpoint was taken"
    return elapsed


def time_replay(position: int, items: int, kib: int, workers: int, expected: float) -> float:
    started = time.perf_counter()
    loader = make_loader(items, kib, workers)
    try:
        iterator = iter(loader)
        for _ in range(position):
            next(iterator)
        first = next(iterator)
        elapsed = time.perf_counter() - started
    finally:
        loader.shutdown()
    assert float(first[0]) == expected
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--kib", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--at", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    args = parser.parse_args()
    print(f"{args.items} items of {args.kib} KiB per epoch, {args.workers} workers, medians of {args.repetitions}:")
    print(f"  {'at':>5}  {'restore':>9}  {'replay':>9}  {'restore/replay':>14}")
    for fraction in args.at:
        position = int(fraction * args.items)
        state, expected = checkpoint_at(position, args.items, args.kib, args.workers)
        restore, replay = [], []
        for _ in range(args.repetitions):
            restore.append(time_restore(state, args.workers, expected))
            replay.append(time_replay(position, args.items, args.kib, args.workers, expected))
        r, p = statistics.median(restore), statistics.median(replay)
        print(f"  {fraction:>5.0%}  {r:>8.3f}s  {p:>8.3f}s  {r / p:>14.1%}")


if __name__ == "__main__":
    main()
