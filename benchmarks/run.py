#!/usr/bin/env python
"""Benchmark suite: mprs_plus against torchdata's MultiProcessingReadingService, torch's
DataLoader, in-process iteration and SPDL's iterate_in_subprocess with its zero-copy
shared-memory pool (one subprocess, when spdl is installed), on the same workloads,
measured interleaved.

    python benchmarks/run.py                 full run (5 repetitions, memory check included)
    python benchmarks/run.py --quick         the whole suite in under a minute (smoke test)
    python benchmarks/run.py --context spawn
    python benchmarks/run.py --workers 1,2,4,8   a sweep: the suite once per worker count,
                                             then every throughput against the count

Prints a table of medians, ratios and target verdicts; writes JSON (with environment
metadata), Markdown and a PNG plot to benchmarks/results/ or --out DIR. Speed figures are
reported, never asserted: the exit status is non-zero only when the suite itself breaks.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import warnings
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Run as a script, this folder is first on sys.path; the suite imports itself (and, in a
# source checkout, mprs_plus) from the repository root instead.
if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
    sys.path[0] = str(ROOT)
elif str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# torchdata announces its deprecation on import and on every DataLoader2; once is enough.
warnings.filterwarnings("ignore", message=r"\s*#+\s*WARNING!")

from benchmarks import harness, report  # noqa: E402
from benchmarks.workloads import WORKLOADS  # noqa: E402
from benchmarks.workloads._shared import calibrate_loops  # noqa: E402


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    names = [w.name for w in WORKLOADS]
    parser = argparse.ArgumentParser(
        prog=prog or "benchmarks/run.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="few items, 1 repetition, no memory check, a shutdown cut off after 1 s (<1 min)")
    parser.add_argument("--repetitions", type=int, default=None, help="interleaved repetitions (default 5; 1 with --quick)")
    parser.add_argument(
        "--workers",
        type=_worker_counts,
        default=(2,),
        metavar="N[,N...]",
        help="worker processes of every loader (default 2); several counts run the suite once per count",
    )
    parser.add_argument(
        "--context",
        default="fork",
        choices=multiprocessing.get_all_start_methods(),
        help="start method of every loader (default fork)",
    )
    parser.add_argument(
        "--budget", type=float, default=None, help="seconds of timed streaming per measurement (default 3; 0.3 with --quick)"
    )
    parser.add_argument("--only", default=None, metavar="NAMES", help=f"comma-separated workloads, from: {', '.join(names)}")
    parser.add_argument(
        "--contenders",
        default=",".join(harness.CONTENDERS),
        metavar="NAMES",
        help=f"comma-separated contenders to run (default all: {', '.join(harness.CONTENDERS)})",
    )
    parser.add_argument("--memory-gb", type=float, default=10.0, help="volume the memory check streams (default 10)")
    parser.add_argument(
        "--memory-bound-mib", type=float, default=64.0, help="allowed RSS growth of a worker in the memory check (default 64)"
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the memory check")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="output folder (default benchmarks/results)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _worker_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count or comma-separated counts, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"worker counts must be at least 1, got {text!r}")
    return tuple(dict.fromkeys(counts))  # in the order given, each once


def _select(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[harness.Workload]:
    if args.only:
        wanted = [name.strip() for name in args.only.split(",") if name.strip()]
        unknown = sorted(set(wanted) - {w.name for w in WORKLOADS})
        if unknown:
            parser.error(f"unknown workload(s) {unknown}; choose from {[w.name for w in WORKLOADS]}")
        return [w for w in WORKLOADS if w.name in wanted]
    return [w for w in WORKLOADS if (w.in_quick or not args.quick) and not (args.no_memory and w.name == "memory_growth")]


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    contenders = tuple(c.strip() for c in args.contenders.split(",") if c.strip())
    unknown = sorted(set(contenders) - set(harness.CONTENDERS))
    if unknown or not contenders:
        parser.error(f"unknown contender(s) {unknown}; choose from {list(harness.CONTENDERS)}")
    workloads = _select(args, parser)
    contenders = tuple(c for c in harness.CONTENDERS if c in contenders)  # canonical order
    cpu_loops = calibrate_loops(0.002)
    stamp = f"{datetime.now():%Y%m%d-%H%M%S}"
    runs = []
    for workers in args.workers:
        results = _run_once(args, workloads, contenders, workers, cpu_loops, stamp, sweep=len(args.workers) > 1)
        runs.append(results)
    if len(runs) > 1:
        print()
        print(report.sweep_table(runs))
        stem = f"sweep-{stamp}-{args.context}{'-quick' if args.quick else ''}"
        for kind, path in report.write_sweep(runs, args.out, stem).items():
            print(f"{kind:>8}: {path}")
    return 0


def _run_once(
    args: argparse.Namespace,
    workloads: list[harness.Workload],
    contenders: tuple[str, ...],
    workers: int,
    cpu_loops: int,
    stamp: str,
    sweep: bool,
) -> harness.Results:
    settings = harness.Settings(
        quick=args.quick,
        num_workers=workers,
        context=args.context,
        repetitions=args.repetitions or (1 if args.quick else 5),
        budget_s=args.budget or (0.3 if args.quick else 3.0),
        deadline_s=20.0 if args.quick else 120.0,
        shutdown_limit_s=1.0 if args.quick else 10.0,  # quick: a smoke test, not a shutdown measurement
        reap_grace_s=1.0 if args.quick else 3.0,
        cpu_loops=cpu_loops,
        memory_gb=args.memory_gb,
        memory_bound_mib=args.memory_bound_mib,
    )
    results = harness.run_suite(workloads, settings, contenders, progress=not args.no_progress)
    rows = report.summarize(results)
    print(report.table(results, rows))
    workers_part = f"-w{workers}" if sweep else ""
    stem = f"bench-{stamp}-{settings.context}{workers_part}{'-quick' if settings.quick else ''}"
    paths = report.write(results, rows, args.out, stem)
    print()
    for kind, path in paths.items():
        print(f"{kind:>8}: {path}")
    print(f"    wall: {results.wall_s:.0f} s")
    return results


if __name__ == "__main__":
    sys.exit(main())
