#!/usr/bin/env python
"""Stress: run pipelines that once hung, and adversarial cases, many times back to back; count stalls.

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

Adversarial cases: what a user can get wrong, each with the outcome the service promises.
    starved  a dispatcher and a filter that keeps nothing on worker 1 after item 2,000, read
             in order, with statistics off then on (alternating by run): PipelineStuckError
             within 15 s of the last item delivered.
    raises   a worker's map raises GeneratorExit, KeyboardInterrupt, SystemExit("msg"),
             FileNotFoundError, CalledProcessError, UnicodeDecodeError and an exception
             whose __str__ raises: each an error of that worker ("Caught X in worker
             process N"), never ProcessDiedError, with the fields num_workers=0 shows.
    checkpoints  damaged checkpoints (next_worker out of range, a count changed,
             num_workers missing, a garbage seed state, another pipeline's): each a
             ValueError naming the field, before any item.
    runahead the main process takes 1 item and waits until production stops: what the
             workers produced must be within the bound the troubleshooting page states.

A stall is a run that delivers no item for ``--stall-after`` seconds while every process
is alive (the service's ``timeout=`` option reports it as ``TimeoutError``); the run is
then shut down and the next one starts. For each run the script also reads the
transport's watchdog rescues from ``stats()``: a wake-up the transport lost and its
watchdog made up for (a hiccup of up to 100 ms instead of a stall). Both should be 0.
Beside them, the watchdog's late wake-ups: the waking process was kept off the CPU
between publishing and waking, which a loaded machine may do (not a bug).

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

from mprs_plus import MultiProcessingReadingService, PipelineStuckError, ProcessDiedError  # noqa: E402


def twice(x: int) -> int:
    return 2 * x


def add_one(x: int) -> int:
    return x + 1


def run_ints(context: str, items: int, stall_after: float) -> tuple[int, tuple[int, int]]:
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


def run_exit(context: str, items: int, stall_after: float) -> tuple[int, tuple[int, int]]:
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


def run_tensors(context: str, items: int, stall_after: float) -> tuple[int, tuple[int, int]]:
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


def _rescues(service: MultiProcessingReadingService) -> tuple[int, int]:
    """The watchdog's wake-ups: (rescues, late wake-ups) over all processes."""
    try:
        processes = service.stats().processes
    except Exception:  # statistics off, or the service already stopped
        return 0, 0
    return sum(p.rescues for p in processes), sum(p.late_wakeups for p in processes)


STARVE_AFTER = 2_000  # items read in order before worker 1 starts to starve


def keep_even_later(x: int) -> bool:
    return x < STARVE_AFTER or x % 2 == 0


def run_starved(context: str, items: int, stall_after: float, collect_stats: bool | None = None) -> tuple[int, tuple[int, int]]:
    """The clock starts at the last item delivered, so a slow start (spawn on a loaded
    machine) does not count: from there, the read must raise within 15 s."""
    run_starved.runs = getattr(run_starved, "runs", 0) + 1  # type: ignore[attr-defined]
    stats = bool(run_starved.runs % 2) if collect_stats is None else collect_stats  # type: ignore[attr-defined]
    pipe = IterableWrapper(range(items)).sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    service = MultiProcessingReadingService(
        2, multiprocessing_context=context, collect_stats=stats, timeout=max(stall_after, 60.0)
    )
    loader = DataLoader2(pipe.filter(keep_even_later), reading_service=service)
    count, last = 0, time.monotonic()
    try:
        for _ in loader:
            count, last = count + 1, time.monotonic()
    except PipelineStuckError:
        took = time.monotonic() - last
        if took > 15 or count < STARVE_AFTER:
            raise AssertionError(
                f"PipelineStuckError {took:.0f} s after item {count} (collect_stats={stats}): "
                f"expected within 15 s of item {STARVE_AFTER} or later"
            ) from None
        return count, (0, 0)
    finally:
        loader.shutdown()
    raise AssertionError(f"a starved read ended without PipelineStuckError (collect_stats={stats})")


class _StrRaises(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


def raise_on_three(kind: str, x: int) -> int:
    if x != 3:
        return x
    import subprocess

    if kind == "FileNotFoundError":
        open("/nonexistent-mprs-plus-stress/file")
    if kind == "CalledProcessError":
        subprocess.run([sys.executable, "-c", "raise SystemExit(3)"], check=True)
    if kind == "UnicodeDecodeError":
        b"\xff".decode("utf-8")
    raise {"GeneratorExit": GeneratorExit, "KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit}.get(
        kind, _StrRaises
    )("msg")


_FIELDS = {
    "FileNotFoundError": ("errno", "strerror", "filename"),
    "CalledProcessError": ("returncode", "cmd"),
    "UnicodeDecodeError": ("encoding", "object", "start", "end", "reason"),
}


def _raised(kind: str, context: str, workers: int) -> BaseException:
    import functools

    pipe = IterableWrapper(range(8)).sharding_filter().map(functools.partial(raise_on_three, kind))
    service = MultiProcessingReadingService(workers, multiprocessing_context=context) if workers else None
    loader = DataLoader2(pipe, reading_service=service)
    try:
        list(loader)
    except BaseException as exc:  # noqa: B036 - what a user gets, BaseException included
        return exc
    finally:
        loader.shutdown()
    raise AssertionError(f"{kind}: nothing raised")


def run_raises(context: str, items: int, stall_after: float) -> tuple[int, tuple[int, int]]:
    kinds = ["GeneratorExit", "KeyboardInterrupt", "SystemExit", *_FIELDS, "_StrRaises"]
    for kind in kinds:
        exc = _raised(kind, context, 2)
        text = "\n".join([str(exc) if kind != "_StrRaises" else "", *getattr(exc, "__notes__", [])])
        if isinstance(exc, ProcessDiedError) or f"Caught {kind} in worker process 1" not in text:
            raise AssertionError(f"{kind} arrived as {type(exc).__name__}: {text[:200]}")
        if kind in _FIELDS:
            local = _raised(kind, context, 0)
            if type(exc) is not type(local) or str(exc) != str(local):
                raise AssertionError(f"{kind} arrived as {type(exc).__name__}: {exc}")
            for field in _FIELDS[kind]:
                if getattr(exc, field) != getattr(local, field):
                    raise AssertionError(f"{kind}.{field}: {getattr(exc, field)!r} != {getattr(local, field)!r}")
    return len(kinds), (0, 0)


def run_checkpoints(context: str, items: int, stall_after: float) -> tuple[int, tuple[int, int]]:
    import pickle

    def service() -> MultiProcessingReadingService:
        return MultiProcessingReadingService(2, multiprocessing_context=context)

    def state_of(pipe: object, taken: int) -> dict:
        loader = DataLoader2(pipe, reading_service=service())
        try:
            iterator = iter(loader)
            for _ in range(taken):
                next(iterator)
            return loader.state_dict()
        finally:
            loader.shutdown()

    state = state_of(IterableWrapper(range(items)).sharding_filter().map(twice), 7)
    other = state_of(IterableWrapper(range(items)).sharding_filter().map(add_one).map(twice), 0)
    record = pickle.loads(state["reading_service_state"])

    def edited(**changes: object) -> dict:
        changed = dict(record)
        for name, value in changes.items():
            if value is None:
                changed.pop(name)
            else:
                changed[name] = value
        return {**state, "reading_service_state": pickle.dumps(changed)}

    cases = {
        "next_worker": edited(next_worker=2),
        "consumed": edited(consumed=[record["consumed"][0] + 40, record["consumed"][1]]),
        "num_workers": edited(num_workers=None),
        "seed_state": edited(seed_state=b"garbage"),
        "graph": {**state, "serialized_datapipe": other["serialized_datapipe"]},
    }
    for field, damaged in cases.items():
        loader = DataLoader2.from_state(damaged, service())
        try:
            next(iter(loader))
        except ValueError as exc:
            if f"field '{field}'" not in str(exc):
                raise AssertionError(f"{field}: the error does not name the field: {exc}") from exc
        else:
            raise AssertionError(f"a checkpoint with a damaged {field!r} was accepted")
        finally:
            loader.shutdown()
    return len(cases), (0, 0)


def run_runahead(context: str, items: int, stall_after: float) -> tuple[int, tuple[int, int]]:
    import os
    import tempfile

    prefetch = (2, 2)
    with tempfile.TemporaryDirectory() as folder:
        counts = os.path.join(folder, "calls")  # one byte appended per call: works under any start method
        open(counts, "wb").close()
        pipe = IterableWrapper(range(items)).sharding_filter().map(_Counted(counts))
        service = MultiProcessingReadingService(
            2, multiprocessing_context=context, worker_prefetch_cnt=prefetch[0], main_prefetch_cnt=prefetch[1]
        )
        loader = DataLoader2(pipe, reading_service=service)
        try:
            next(iter(loader))
            produced, deadline = -1, time.monotonic() + 30
            while os.path.getsize(counts) != produced and time.monotonic() < deadline:  # until production stops
                produced = os.path.getsize(counts)
                time.sleep(1.0)
        finally:
            loader.shutdown()
    messages = max(1, prefetch[0] + -(-prefetch[1] // 2))
    bound = 1 + 2 * (messages + 2) * 64  # docs/troubleshooting.md, "How far the workers run ahead"
    if produced > bound:
        raise AssertionError(f"{produced} items produced ahead, above the stated bound of {bound}")
    return produced, (0, 0)


class _Counted:
    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, item: int) -> int:
        with open(self.path, "ab", buffering=0) as calls:
            calls.write(b"x")
        return item


PIPELINES = {
    "ints": (run_ints, 1_000_000),
    "exit": (run_exit, 1_000),
    "tensors": (run_tensors, 2_000),
    "starved": (run_starved, 200_000),
    "raises": (run_raises, 8),
    "checkpoints": (run_checkpoints, 40),
    "runahead": (run_runahead, 1_000_000),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30, help="runs of each pipeline with each start method (30)")
    parser.add_argument(
        "--pipelines",
        default=",".join(PIPELINES),
        help="comma-separated, from: " + ", ".join(PIPELINES),
    )
    parser.add_argument("--contexts", default="fork,spawn", help="comma-separated start methods (fork,spawn)")
    parser.add_argument(
        "--items", type=int, default=None, help="items per run (default per pipeline: ints 1,000,000, exit 1,000, ...)"
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
    results: dict[tuple[str, str], list[tuple[str, float, tuple[int, int]]]] = {}
    print(f"{'pipeline':<11} {'context':<7} {'run':>4} {'seconds':>8}  {'rescues':>7}  {'late':>4}  outcome", flush=True)
    for name in pipelines:
        run, default_items = PIPELINES[name]
        items = args.items or default_items
        for context in contexts:
            rows = results.setdefault((name, context), [])
            for index in range(args.runs):
                if stop_at is not None and time.monotonic() > stop_at:
                    break
                started = time.monotonic()
                watchdog = (0, 0)
                try:
                    _, watchdog = run(context, items, args.stall_after)
                    outcome = "ok"
                except TimeoutError as exc:
                    outcome = f"STALL: {exc}"
                except Exception as exc:
                    outcome = f"FAILED: {type(exc).__name__}: {exc}"
                seconds = time.monotonic() - started
                rows.append((outcome, seconds, watchdog))
                rescues, late = watchdog
                print(
                    f"{name:<11} {context:<7} {index + 1:>4} {seconds:>8.1f}  {rescues:>7}  {late:>4}  {outcome}",
                    flush=True,
                )

    print("\nsummary")
    bad = 0
    for (name, context), rows in results.items():
        stalls = sum(outcome.startswith("STALL") for outcome, _, _ in rows)
        failed = sum(outcome.startswith("FAILED") for outcome, _, _ in rows)
        rescues = sum(w[0] for _, _, w in rows)
        late = sum(w[1] for _, _, w in rows)
        seconds = sum(s for _, s, _ in rows)
        bad += stalls + failed
        print(
            f"  {name:<11} {context:<6} {len(rows):>3} runs  {stalls} stalls  {failed} failures  "
            f"{rescues} watchdog rescues  {late} late wake-ups  {seconds:7.1f} s"
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
