#!/usr/bin/env python
"""Where the time to the first item goes, and how much shared memory a loader commits.

    python benchmarks/startup_profile.py                      1, 2, 8, 16 workers
    python benchmarks/startup_profile.py --workers 2,8 --profile

For each worker count it builds fresh loaders over ``range -> sharding_filter -> map``, the
contenders taking turns trial by trial (so load from elsewhere hits them alike), and times
in the main process what ``benchmarks/workloads/startup_shutdown.py`` times: from creating
the loader (DataLoader2 / DataLoader) to ``next(iter(loader))`` returning the first item.
Medians of ``--trials``.

For mprs_plus it also splits that time into the main process's phases (time spent in each,
nested calls not counted twice):

    construct   the DataLoader2 object
    plan        discover the graph and split it into segments
    copies      copy the worker and dispatch segments, once for all children
    channels    open every channel (memfd, mapping, wake-up pipes)
    processes   start the children (fork, or spawn's pickling)
    messages    the first epoch's Reset messages
    first item  the rest: waiting for the first item, and reading it

and reports the shared memory committed per worker at rest (after the first item): the
proportional resident size (PSS) of every mprs_plus channel mapping, summed over the main
process and its children, so each page counts once, divided by the worker count.
``--profile`` adds the main process's own hot spots on the path to the first item
(cProfile, cumulative time), which shows the serial parts.

A report, not a test: nothing is asserted. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
    sys.path[0] = str(HERE.parent)

warnings.filterwarnings("ignore", message=r"\s*#+\s*WARNING!")
warnings.filterwarnings("ignore", message=r"This DataLoader will create \d+ worker processes")

import psutil  # noqa: E402

from benchmarks import harness  # noqa: E402
from benchmarks.workloads._shared import ShardedRange, identity, mapped_range  # noqa: E402

ITEMS = 1_000_000
CHANNEL_MAPPING = "memfd:mprs_plus"
PHASES = ("plan", "copies", "channels", "processes", "messages")


def committed_shared_mib() -> float:
    """PSS of every mprs_plus channel mapping in this process and its children, in MiB."""
    total = 0
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            maps = process.memory_maps(grouped=False)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += sum(m.pss for m in maps if CHANNEL_MAPPING in m.path)
    return total / harness.MiB


class PhaseClock:
    """Time spent in a few functions of the main process, each call's nested timed calls
    counted only once (in the innermost phase)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self._stack: list[float] = []

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        function = getattr(owner, name)
        clock, spent, stack = time.perf_counter, self.spent, self._stack

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = clock()
            stack.append(0.0)
            try:
                return function(*args, **kwargs)
            finally:
                took = clock() - started
                inner = stack.pop()
                spent[phase] = spent.get(phase, 0.0) + took - inner
                if stack:
                    stack[-1] += took

        setattr(owner, name, timed)


def phase_clock() -> PhaseClock:
    """Hooks the main process's start-up steps of mprs_plus (this process only)."""
    from mprs_plus import reading_service
    from mprs_plus.backends import local
    from mprs_plus.runtime.main import service, supervisor

    phases = PhaseClock()
    phases.wrap(reading_service, "plan", "plan")
    phases.wrap(service, "build_worker_program", "copies")
    phases.wrap(service, "build_dispatch_sources", "copies")
    phases.wrap(local, "open_channel", "channels")  # the local backend opens the channels
    phases.wrap(supervisor.Supervisor, "launch", "processes")
    phases.wrap(service.ServiceRuntime, "begin_epoch", "messages")
    return phases


@contextmanager
def profiling(profile: cProfile.Profile | None) -> Iterator[None]:
    if profile is not None:
        profile.enable()
    try:
        yield
    finally:
        if profile is not None:
            profile.disable()


def trial(
    contender: str, settings: harness.Settings, phases: PhaseClock | None, profile: cProfile.Profile | None
) -> dict[str, float]:
    clock = time.perf_counter
    if phases is not None:
        phases.spent.clear()
    start = clock()
    with profiling(profile):
        loader = harness.open_loader(
            contender, settings, pipe=mapped_range(ITEMS, identity), dataset=ShardedRange(ITEMS, identity)
        )
        built = clock()
        try:
            next(iter(loader))
        except BaseException:
            harness.close_within(loader, settings)
            harness.end_children(grace_s=settings.reap_grace_s)
            raise
    first = clock()
    row = {"construct": built - start, "first_item": first - start}
    try:
        if contender == harness.MPRS_PLUS:
            row["shared_mib"] = committed_shared_mib() / settings.num_workers
            spent = dict(phases.spent) if phases is not None else {}
            for phase in PHASES:
                row[phase] = spent.get(phase, 0.0)
            row["wait"] = row["first_item"] - row["construct"] - sum(spent.values())
    finally:
        harness.close_within(loader, settings)
        harness.end_children(grace_s=settings.reap_grace_s)
    return row


def run_count(
    workers: int, contenders: list[str], trials: int, context: str, profile: cProfile.Profile | None
) -> dict[str, dict[str, float]]:
    """Medians per contender, the contenders taking turns trial by trial."""
    settings = harness.Settings(num_workers=workers, context=context, shutdown_limit_s=10.0, reap_grace_s=3.0)
    phases = phase_clock() if harness.MPRS_PLUS in contenders else None
    rows: dict[str, list[dict[str, float]]] = {c: [] for c in contenders}
    for n in range(trials):
        for contender in contenders[n % len(contenders) :] + contenders[: n % len(contenders)]:
            mine = contender == harness.MPRS_PLUS
            rows[contender].append(trial(contender, settings, phases if mine else None, profile if mine else None))
    return {c: {key: statistics.median(r[key] for r in found) for key in found[0]} for c, found in rows.items()}


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1,2,8,16", help="comma-separated worker counts (default 1,2,8,16)")
    parser.add_argument("--trials", type=int, default=7, help="loaders per count and contender (default 7)")
    parser.add_argument("--context", default="fork", help="start method (default fork)")
    parser.add_argument("--contenders", default=f"{harness.MPRS_PLUS},{harness.TORCH}", help="comma-separated")
    parser.add_argument("--profile", action="store_true", help="also print mprs_plus's main-process hot spots")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.workers.split(",") if n.strip()]
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    others = [c for c in contenders if c != harness.MPRS_PLUS]
    mine = harness.MPRS_PLUS in contenders
    print(f"first item, ms (medians of {args.trials}, {args.context}); mprs_plus's phases in its main process, ms")
    header = ["workers", *(f"{c}" for c in contenders)]
    if mine:
        header += [f"vs {c}" for c in others] + ["construct", *PHASES, "first item", "shared MiB/worker"]
    print(" | ".join(header))
    for workers in counts:
        profile = cProfile.Profile() if args.profile and mine else None
        med = run_count(workers, contenders, args.trials, args.context, profile)
        cells = [str(workers), *(ms(med[c]["first_item"]) for c in contenders)]
        if mine:
            own = med[harness.MPRS_PLUS]
            cells += [f"{own['first_item'] / med[c]['first_item']:.2f}x" for c in others]
            cells += [ms(own[p]) for p in ("construct", *PHASES, "wait")] + [f"{own['shared_mib']:.2f}"]
        print(" | ".join(cells), flush=True)
        if profile is not None:
            out = io.StringIO()
            stats = pstats.Stats(profile, stream=out)
            stats.sort_stats("cumulative").print_stats(r"mprs_plus|multiprocessing|copy|pickle", 15)
            print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
