"""What ``worker_restarts`` costs: the stall when a worker dies deep into an epoch, and the
rate of tiny batches with the option set.

    python benchmarks/worker_restarts.py [--samples 4000] [--at 0.8] [--workers 2] [--repetitions 3]

Death to the next batch. A map-style dataset of 2 ms samples (batches of 8), read by
``mprs_plus.DataLoader``; the worker that reads sample ``at * samples`` kills itself with
SIGKILL (the first time). Timed: from the kill to the arrival of the batch holding that
sample, made by the replacement. Three ways: the replacement goes on from the latest
generator record (the default), or replays the worker's epoch from its start (records
only at the epoch's start, as a stream that cannot jump does); and, for scale, the
uninterrupted run's time per batch.

Tiny batches. Batches of 4 ints from a list, ``--tiny`` of them, with and without
``worker_restarts=2`` (no death): batches per second, and the CPU time per batch of the
main process and the workers together (steadier than the rate on a shared machine); the
two interleaved, medians.

Runs under fork (the setting of the record interval reaches the workers that way).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

import mprs_plus  # noqa: E402
from mprs_plus.runtime import generators  # noqa: E402
from benchmarks.workloads._shared import Ints  # noqa: E402


class Slow(Dataset):
    """Samples that take 2 ms and draw from torch's generator; one kills its process once."""

    def __init__(self, n: int, kill_at: int, marker: str) -> None:
        self.n, self.kill_at, self.marker = n, kill_at, marker

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.kill_at and not os.path.exists(self.marker):
            with open(self.marker, "w") as note:
                note.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.002)
        return torch.tensor([i, float(torch.rand(()))])


def death_to_next_batch(samples: int, at: float, workers: int, record_seconds: float) -> tuple[float, float]:
    """(seconds from the kill to the batch it interrupted, seconds per batch before it)."""
    generators.RECORD_SECONDS = record_seconds
    folder = tempfile.mkdtemp()
    marker = os.path.join(folder, "killed")
    kill_at = int(samples * at)
    loader = mprs_plus.DataLoader(
        Slow(samples, kill_at, marker), batch_size=8, num_workers=workers, worker_restarts=1,
        multiprocessing_context="fork",
    )
    arrived = {}
    started = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for number, batch in enumerate(loader):
            arrived[number] = time.time()
            if int(batch[0, 0]) <= kill_at <= int(batch[-1, 0]):
                stall = arrived[number] - float(Path(marker).read_text())
                per_batch = (float(Path(marker).read_text()) - started) / max(1, number)
                os.remove(marker)
                os.rmdir(folder)
                return stall, per_batch
    raise RuntimeError("the batch with the killed sample never came")


def tiny_rate(batches: int, workers: int, restarts: int) -> tuple[float, float]:
    """(batches per second, CPU seconds per batch of the main process and the workers):
    the CPU figure holds on a loaded machine, where the rate swings with the neighbours."""
    import psutil

    loader = mprs_plus.DataLoader(
        Ints(batches * 4), batch_size=4, num_workers=workers, worker_restarts=restarts, multiprocessing_context="fork",
        persistent_workers=True,
    )
    list(loader)  # a first epoch: the workers started and warm
    children = psutil.Process().children()
    cpu = [process.cpu_times() for process in [psutil.Process(), *children]]
    begun = time.perf_counter()
    count = sum(1 for _ in loader)
    elapsed = time.perf_counter() - begun
    after = [process.cpu_times() for process in [psutil.Process(), *children]]
    used = sum(b.user + b.system - a.user - a.system for a, b in zip(cpu, after))
    del loader
    return count / elapsed, used / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--at", type=float, default=0.8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tiny", type=int, default=50000)
    parser.add_argument("--repetitions", type=int, default=3)
    args = parser.parse_args()
    multiprocessing.set_start_method("fork", force=True)
    default_seconds = generators.RECORD_SECONDS
    jump, replay, per_batch = [], [], []
    for _ in range(args.repetitions):
        stall, each = death_to_next_batch(args.samples, args.at, args.workers, default_seconds)
        jump.append(stall)
        per_batch.append(each)
        replay.append(death_to_next_batch(args.samples, args.at, args.workers, float("inf"))[0])
    generators.RECORD_SECONDS = default_seconds
    print(f"death to the next batch, sample {int(args.samples * args.at)} of {args.samples} (2 ms each, batches of 8, "
          f"{args.workers} workers), medians of {args.repetitions}:")
    print(f"  from the latest record      {statistics.median(jump) * 1e3:8.0f} ms")
    print(f"  from the epoch's start      {statistics.median(replay) * 1e3:8.0f} ms")
    print(f"  one batch, uninterrupted    {statistics.median(per_batch) * 1e3:8.0f} ms (the loop's pace)")
    without, with_restarts = [], []
    for repetition in range(args.repetitions):
        for restarts in (0, 2) if repetition % 2 == 0 else (2, 0):
            (with_restarts if restarts else without).append(tiny_rate(args.tiny, args.workers, restarts))
    a, b = (statistics.median(r for r, _ in runs) for runs in (without, with_restarts))
    ca, cb = (statistics.median(c for _, c in runs) for runs in (without, with_restarts))
    print(f"tiny batches (4 ints), {args.tiny} per epoch (the second of persistent workers), interleaved, "
          f"medians of {args.repetitions}:")
    print(f"  worker_restarts=0  {a:10,.0f} batches/s  {ca * 1e6:6.1f} µs of CPU per batch (main + workers)")
    print(f"  worker_restarts=2  {b:10,.0f} batches/s  {cb * 1e6:6.1f} µs of CPU per batch  "
          f"(rate {b / a:.1%}, CPU {cb / ca:.1%} of those without)")


if __name__ == "__main__":
    main()
