#!/usr/bin/env python
"""Where the time to the first item goes, and how much shared memory a loader commits.

    python benchmarks/startup_profile.py                      1, 2, 8, 16 workers
    python benchmarks/startup_profile.py --workers 2,8 --profile

For each worker count and each contender (mprs_plus, torchdata's reading service, torch's
DataLoader) it builds a fresh loader over ``range -> sharding_filter -> map`` and times,
in the main process:

    construct   the loader object (DataLoader2 / DataLoader)
    first item  iter() + next(): process start, graph copies, channels, the first item

medians of ``--trials``. For mprs_plus it also reports the shared memory committed by the
running loader at rest (after the first item): the proportional resident size (PSS) of
every mprs_plus channel mapping, summed over the main process and its children, so each
page counts once. ``--profile`` adds the main process's own hot spots on the path to the
first item (cProfile, cumulative time), which shows the serial parts.

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
from pathlib import Path

HERE = Path(__file__).resolve().parent
if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
    sys.path[0] = str(HERE.parent)

warnings.filterwarnings("ignore", message=r"\s*#+\s*WARNING!")

import psutil  # noqa: E402

from benchmarks import harness  # noqa: E402
from benchmarks.workloads._shared import ShardedRange, identity, mapped_range  # noqa: E402

ITEMS = 1_000_000
CHANNEL_MAPPING = "memfd:mprs_plus"


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


def trial(contender: str, settings: harness.Settings, profile: cProfile.Profile | None) -> dict[str, float]:
    clock = time.perf_counter
    start = clock()
    loader = harness.open_loader(
        contender, settings, pipe=mapped_range(ITEMS, identity), dataset=ShardedRange(ITEMS, identity)
    )
    built = clock()
    try:
        if profile is not None:
            profile.enable()
        next(iter(loader))
        if profile is not None:
            profile.disable()
        first = clock()
        shared = committed_shared_mib() if contender == harness.MPRS_PLUS else float("nan")
    finally:
        harness.close_within(loader, settings)
        harness.end_children(grace_s=settings.reap_grace_s)
    return {"construct": built - start, "first_item": first - start, "shared_mib": shared}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1,2,8,16", help="comma-separated worker counts (default 1,2,8,16)")
    parser.add_argument("--trials", type=int, default=5, help="loaders per count and contender (default 5)")
    parser.add_argument("--context", default="fork", help="start method (default fork)")
    parser.add_argument(
        "--contenders", default=f"{harness.MPRS_PLUS},{harness.TORCHDATA},{harness.TORCH}", help="comma-separated"
    )
    parser.add_argument("--profile", action="store_true", help="also print mprs_plus's main-process hot spots")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.workers.split(",") if n.strip()]
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    print(f"{'workers':>7}  {'contender':<10}  {'construct ms':>12}  {'first item ms':>13}  {'shared MiB':>10}")
    for workers in counts:
        settings = harness.Settings(num_workers=workers, context=args.context, shutdown_limit_s=10.0, reap_grace_s=3.0)
        for contender in contenders:
            profile = cProfile.Profile() if args.profile and contender == harness.MPRS_PLUS else None
            trials = [trial(contender, settings, profile) for _ in range(args.trials)]
            med = {key: statistics.median(t[key] for t in trials) for key in trials[0]}
            shared = "" if med["shared_mib"] != med["shared_mib"] else f"{med['shared_mib']:.1f}"
            print(
                f"{workers:>7}  {contender:<10}  {med['construct'] * 1e3:>12.1f}  "
                f"{med['first_item'] * 1e3:>13.1f}  {shared:>10}",
                flush=True,
            )
            if profile is not None:
                out = io.StringIO()
                stats = pstats.Stats(profile, stream=out)
                stats.sort_stats("cumulative").print_stats(r"mprs_plus|multiprocessing|copy|pickle", 15)
                print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
