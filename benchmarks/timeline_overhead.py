"""What profiling costs: the profiler's ranges and the timeline, on and off, side by side.

1. The range torch's profiler sees around each ``next()`` of ``mprs_plus.DataLoader``:
   per batch, a loop over an in-process loader (``num_workers=0``, batches of one int:
   nothing else to pay for) calling ``next()`` with the range's check and without it
   (``_next``, what the check wraps), with no profiler active; then the same loop under
   ``torch.profiler.profile()``; torch's own loader beside it, both ways.
2. The timeline (``timeline=True``) against none: tiny items through two workers, the
   worst case (no work per item, so the spans' bookkeeping is the largest share it can
   be), and batches of 64 samples that take 20 us each.

Runs interleaved (on, off, on, off, ...) and prints medians::

    python benchmarks/timeline_overhead.py [--items 200000] [--repetitions 5]
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

import torch  # noqa: E402
from torch.profiler import profile  # noqa: E402
from torchdata.dataloader2 import DataLoader2  # noqa: E402
from torchdata.datapipes.iter import IterableWrapper  # noqa: E402

import mprs_plus  # noqa: E402


def identity(x: int) -> int:
    return x


class Work(torch.utils.data.Dataset):
    """Samples that take ``seconds`` of CPU each."""

    def __init__(self, n: int, seconds: float) -> None:
        self.n, self.seconds = n, seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        end = time.perf_counter() + self.seconds
        while time.perf_counter() < end:
            pass
        return i


def per_batch_us(batches: int, how: str) -> float:
    """Microseconds per ``next()`` of an in-process loader of one-int batches (torch's
    own for ``how`` starting with "torch")."""
    kind = torch.utils.data.DataLoader if how.startswith("torch") else mprs_plus.DataLoader
    loader = kind(list(range(batches)), batch_size=1, collate_fn=identity)
    iterator = iter(loader)
    step = iterator._next if how == "unwrapped" else iterator.__next__
    started = time.perf_counter()
    if how.endswith("profiled"):
        with profile():
            for _ in range(batches):
                step()
    else:
        for _ in range(batches):
            step()
    return (time.perf_counter() - started) / batches * 1e6


def tiny_rate(timeline: bool, items: int) -> float:
    pipe = IterableWrapper(range(items)).sharding_filter().map(identity)
    loader = DataLoader2(pipe, reading_service=mprs_plus.MultiProcessingReadingService(2, timeline=timeline))
    try:
        next(iter(loader))  # start the processes, untimed
        started = time.perf_counter()
        count = sum(1 for _ in loader)
        return count / (time.perf_counter() - started)
    finally:
        loader.shutdown()


def batch_rate(timeline: bool, batches: int) -> float:
    loader = mprs_plus.DataLoader(Work(batches * 64, 20e-6), batch_size=64, num_workers=2, timeline=timeline)
    iterator = iter(loader)
    next(iterator)  # start the processes, untimed
    started = time.perf_counter()
    count = 1 + sum(1 for _ in iterator)
    return count / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=200_000)
    parser.add_argument("--batches", type=int, default=400)
    parser.add_argument("--repetitions", type=int, default=5)
    args = parser.parse_args()
    with profile():  # the profiler's first start sets it up (a fraction of a second): not a batch's cost
        pass
    calls: dict[str, list[float]] = {"unwrapped": [], "checked": [], "profiled": [], "torch": [], "torch profiled": []}
    for _ in range(args.repetitions):
        for how in calls:
            calls[how].append(per_batch_us(20_000, how))
    base, checked, profiled = (statistics.median(calls[how]) for how in ("unwrapped", "checked", "profiled"))
    print(f"profiler range, per next() of an in-process loader, medians of {args.repetitions}:")
    print(f"  without the range's check     {base:7.2f} us")
    print(f"  with it, no profiler          {checked:7.2f} us   (+{checked - base:.2f} us)")
    print(f"  with it, under profile()      {profiled:7.2f} us   (+{profiled - base:.2f} us)")
    theirs, theirs_profiled = statistics.median(calls["torch"]), statistics.median(calls["torch profiled"])
    print(f"  torch's loader                {theirs:7.2f} us")
    print(f"  torch's, under profile()      {theirs_profiled:7.2f} us   (+{theirs_profiled - theirs:.2f} us)")
    for name, measure, count, unit in (
        ("tiny items, 2 workers", tiny_rate, args.items, "items/s"),
        ("batches of 64 x 20 us samples, 2 workers", batch_rate, args.batches, "batches/s"),
    ):
        rates: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repetitions):
            for on in (True, False):
                rates[on].append(measure(on, count))
        on, off = statistics.median(rates[True]), statistics.median(rates[False])
        print(f"timeline, {name}, medians of {args.repetitions}:")
        print(f"  timeline=True    {on:>10,.0f} {unit}")
        print(f"  timeline=False   {off:>10,.0f} {unit}")
        print(f"  overhead         {1 - on / off:>10.1%}")


if __name__ == "__main__":
    main()
