#!/usr/bin/env python
"""Stress: run two pipelines that once hung, many times back to back, and count stalls.

    python benchmarks/stress.py                      30 runs of each pipeline, fork and spawn
    python benchmarks/stress.py --runs 5 --contexts fork --pipelines ints
    python benchmarks/stress.py --minutes 20         stop starting runs after 20 minutes

Pipelines
    ints   1,000,000 ints through ``sharding_round_robin_dispatch`` then ``map`` in
           2 workers: long streams through small dispatch channels, where the producer
           and its readers keep going to sleep and waking each other.
    exit   ``shuffle().prefetch(20)``, the dispatcher, ``map().batch(16)``, 2 workers, no
           prefetch on either side (``worker_prefetch_cnt=0, main_prefetch_cnt=0``): two
           epochs, then shut down, as torchdata's own exit test does.
    tensors  arrays of 64 KiB (copied) to 8 MiB (lent; sizes vary, so the lend area fragments and
           coalesces) sent through the dispatcher to 2 workers, which make tensors of
           them; the loop keeps one item in seven for a while and checks every item's
           bytes, so a lent buffer given back too early shows as a wrong value.

A stall is a run that delivers no item for ``--stall-after`` seconds while every process
is alive (the service's ``timeout=`` option reports it as ``TimeoutError``); the run is
then shut down and the next one starts. For each run the script also reads the
transport's watchdog rescues from ``stats()``: a wake-up the transport lost and its
watchdog made up for (a hiccup of up to 100 ms instead of a stall). Both should be 0.

Not part of the test suite: a full run takes many minutes. Meant to be run on a loaded
machine (say, next to a test run), where the scheduling that exposes races is most varied.
Exit status: 0 when no run stalled or failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
    sys.path[0] = str(ROOT)
elif str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

warnings.filterwarnings("ignore", message=r"\s*#+\s*WARNING!")

from torchdata.dataloader2 import DataLoader2  # noqa: E402
from torchdata.datapipes.iter import IterableWrapper  # noqa: E402
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES  # noqa: E402

from mprs_plus import MultiProcessingReadingService  # noqa: E402


def twice(x: int) -> int:
    return 2 * x


def add_one(x: int) -> int:
    return x + 1


def run_ints(context: str, items: int, stall_after: float) -> tuple[int, int]:
    pipe = IterableWrapper(range(items)).sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    pipe = pipe.map(twice)
    service = MultiProcessingReadingService(2, multiprocessing_context=context, timeout=stall_after)
    loader = DataLoader2(pipe, reading_service=service)
    try:
        count = 0
        total = 0
        for value in loader:
            count += 1
            total += value
        if count != items or total != items * (items - 1):
            raise AssertionError(f"wrong output: {count} items, sum {total}")
        return count, _rescues(service)
    finally:
        loader.shutdown()


def run_exit(context: str, items: int, stall_after: float) -> tuple[int, int]:
    pipe = IterableWrapper(range(items)).shuffle().prefetch(20)
    pipe = pipe.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING).map(add_one).batch(16)
    service = MultiProcessingReadingService(
        2, worker_prefetch_cnt=0, main_prefetch_cnt=0, multiprocessing_context=context, timeout=stall_after
    )
    loader = DataLoader2(pipe, reading_service=service)
    try:
        count = 0
        for _epoch in range(2):
            seen = sorted(x for batch in loader for x in batch)
            if seen != list(range(1, items + 1)):
                raise AssertionError(f"wrong output: {len(seen)} items")
            count += len(seen)
        return count, _rescues(service)
    finally:
        loader.shutdown()


def sized_array(i: int) -> "numpy.ndarray":
    import numpy

    size = (64 << 10) << (i % 8)  # 64 KiB .. 8 MiB
    return numpy.full(size + (i % 5) * 4096, i % 251, dtype=numpy.uint8)


def as_tensor(array: "numpy.ndarray") -> "torch.Tensor":
    import torch

    return torch.from_numpy(array.copy())


def run_tensors(context: str, items: int, stall_after: float) -> tuple[int, int]:
    pipe = IterableWrapper(range(items)).map(sized_array)
    pipe = pipe.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING).map(as_tensor)
    service = MultiProcessingReadingService(2, multiprocessing_context=context, timeout=stall_after)
    loader = DataLoader2(pipe, reading_service=service)
    try:
        kept: list[tuple[int, object]] = []
        count = 0
        for tensor in loader:
            value = count % 251
            if tensor.numel() < 64 << 10 or int(tensor[0]) != value or int(tensor[-1]) != value:
                raise AssertionError(f"item {count}: wrong bytes")
            if count % 7 == 0:
                kept.append((value, tensor))
            if len(kept) > 20:  # hold some for a while, then check them again and let go
                for old, held in kept:
                    if int(held[0]) != old or int(held.min()) != old or int(held.max()) != old:
                        raise AssertionError("a kept item changed under the loop")
                kept.clear()
            count += 1
        if count != items:
            raise AssertionError(f"wrong output: {count} items")
        return count, _rescues(service)
    finally:
        loader.shutdown()


def _rescues(service: MultiProcessingReadingService) -> int:
    try:
        return sum(process.rescues for process in service.stats().processes)
    except Exception:  # statistics off, or the service already stopped
        return 0


PIPELINES = {"ints": (run_ints, 1_000_000), "exit": (run_exit, 1_000), "tensors": (run_tensors, 2_000)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30, help="runs of each pipeline with each start method (30)")
    parser.add_argument("--pipelines", default="ints,exit,tensors", help="comma-separated, from: ints, exit, tensors")
    parser.add_argument("--contexts", default="fork,spawn", help="comma-separated start methods (fork,spawn)")
    parser.add_argument(
        "--items", type=int, default=None, help="items per run (ints: 1,000,000; exit: 1,000; tensors: 2,000)"
    )
    parser.add_argument("--stall-after", type=float, default=30.0, help="seconds without an item that count as a stall")
    parser.add_argument("--minutes", type=float, default=None, help="start no run after this many minutes")
    args = parser.parse_args(argv)
    pipelines = [name.strip() for name in args.pipelines.split(",") if name.strip()]
    contexts = [name.strip() for name in args.contexts.split(",") if name.strip()]
    for name in pipelines:
        if name not in PIPELINES:
            parser.error(f"unknown pipeline {name!r}; choose from {sorted(PIPELINES)}")
    for context in contexts:
        if context not in multiprocessing.get_all_start_methods():
            parser.error(f"unknown start method {context!r}")

    stop_at = None if args.minutes is None else time.monotonic() + 60 * args.minutes
    results: dict[tuple[str, str], list[tuple[str, float, int]]] = {}
    print(f"{'pipeline':<8} {'context':<7} {'run':>4} {'seconds':>8}  {'rescues':>7}  outcome", flush=True)
    for name in pipelines:
        run, default_items = PIPELINES[name]
        items = args.items or default_items
        for context in contexts:
            rows = results.setdefault((name, context), [])
            for index in range(args.runs):
                if stop_at is not None and time.monotonic() > stop_at:
                    break
                started = time.monotonic()
                rescues = 0
                try:
                    _, rescues = run(context, items, args.stall_after)
                    outcome = "ok"
                except TimeoutError as exc:
                    outcome = f"STALL: {exc}"
                except Exception as exc:
                    outcome = f"FAILED: {type(exc).__name__}: {exc}"
                seconds = time.monotonic() - started
                rows.append((outcome, seconds, rescues))
                print(f"{name:<8} {context:<7} {index + 1:>4} {seconds:>8.1f}  {rescues:>7}  {outcome}", flush=True)

    print("\nsummary")
    bad = 0
    for (name, context), rows in results.items():
        stalls = sum(outcome.startswith("STALL") for outcome, _, _ in rows)
        failed = sum(outcome.startswith("FAILED") for outcome, _, _ in rows)
        rescues = sum(r for _, _, r in rows)
        seconds = sum(s for _, s, _ in rows)
        bad += stalls + failed
        print(
            f"  {name:<5} {context:<6} {len(rows):>3} runs  {stalls} stalls  {failed} failures  "
            f"{rescues} watchdog rescues  {seconds:7.1f} s"
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
