"""What ``seeding="batch"`` costs per batch against torch's ``"worker"`` seeding.

Tiny batches are the worst case: one int per sample, a few samples a batch, so the per-batch
seeding (one ``SeedSequence``, three seed calls; with ``num_workers=0`` also the trainer's
generators captured and loaded around the batch) is the largest share it can be. Runs
interleaved (worker, batch, worker, batch, ...) and prints medians::

    python benchmarks/seeding_cost.py [--batches 20000] [--batch-size 4] [--repetitions 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy  # noqa: E402,F401  (loaded as in a training script: its generator is seeded and kept too)

import mprs_plus  # noqa: E402
from benchmarks.workloads._shared import Ints  # noqa: E402


def seconds_per_batch(seeding: str, workers: int, batches: int, batch_size: int) -> float:
    loader = mprs_plus.DataLoader(
        Ints(batches * batch_size), batch_size=batch_size, num_workers=workers, seeding=seeding, collect_stats=False
    )
    iterator = iter(loader)
    next(iterator)  # start the processes, untimed
    started = time.perf_counter()
    count = sum(1 for _ in iterator)
    return (time.perf_counter() - started) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repetitions", type=int, default=5)
    args = parser.parse_args()
    for workers in (0, 2):
        times: dict[str, list[float]] = {"worker": [], "batch": []}
        for _ in range(args.repetitions):
            for seeding in times:
                times[seeding].append(seconds_per_batch(seeding, workers, args.batches, args.batch_size))
        worker, batch = statistics.median(times["worker"]), statistics.median(times["batch"])
        print(f"num_workers={workers}, batches of {args.batch_size} ints, medians of {args.repetitions}:")
        print(f'  seeding="worker"  {worker * 1e6:8.1f} us/batch')
        print(f'  seeding="batch"   {batch * 1e6:8.1f} us/batch  (+{(batch - worker) * 1e6:.1f} us, {batch / worker:.2f}x)')


if __name__ == "__main__":
    main()
