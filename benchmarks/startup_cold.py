#!/usr/bin/env python
"""The first item of the first loader of a fresh process, imports included, against the
same loader built again in that process.

    python benchmarks/startup_cold.py                     9 samples per contender, 2 workers
    python benchmarks/startup_cold.py --samples 15 --workers 1,2 --contenders mprs_plus,torch

A training script pays for the loader's own imports once, before its first item: for
mprs_plus that is torchdata's DataLoader2 and this package, for torch's DataLoader nothing
beyond torch. ``startup_profile.py`` and the suite's start-up workload time loaders in a
process that has imported everything already (warm); this script starts a fresh
interpreter per sample, so each sample pays what a new training script pays.

One sample (``--sample CONTENDER``, what the driver runs in each fresh interpreter):

    import torch, torchdata's DataPipes, build the pipeline   (the user's own code: not timed)
    t0 -> the loader's imports -> create the loader -> first item: t1    cold
    shut it down; create a second loader -> first item                   warm

and prints one JSON line: ``cold_first_item``, ``imports`` (the part of it spent
importing the loader's modules, before creating it), ``cold_main_cpu`` (the CPU time this
process spent on the cold first item: on a busy machine it varies far less than the wall
time) and ``warm_first_item``, in seconds.
The driver alternates the contenders sample by sample (the first one rotating), so load
from elsewhere hits them alike, and prints medians. Modules load from their bytecode
caches, as an installed package's do (pip compiles them at install time): samples run
with bytecode writing on, after one untimed sample per contender that fills the caches. The suite's ``cold_start`` workload
runs the same samples (``benchmarks/workloads/cold_start.py``).

A report, not a test: nothing is asserted. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
    sys.path[0] = str(ROOT)

warnings.filterwarnings("ignore", message=r"\s*#+\s*WARNING!")
warnings.filterwarnings("ignore", message=r"This DataLoader will create \d+ worker processes")

CONTENDERS = ("mprs_plus", "torch", "torchdata")
ITEMS = 1_000_000  # far more than any loader prefetches, as in the start-up workload
SAMPLE_TIMEOUT_S = 120.0


def _import_loader(contender: str) -> None:
    """What creating ``contender``'s loader needs beyond the user's own imports."""
    if contender == "torch":
        import torch.utils.data  # noqa: F401  (loaded with torch already)
    elif contender == "mprs_plus":
        from torchdata.dataloader2 import DataLoader2  # noqa: F401

        from mprs_plus import MultiProcessingReadingService  # noqa: F401
    elif contender == "torchdata":
        from torchdata.dataloader2 import DataLoader2, MultiProcessingReadingService  # noqa: F401
    else:
        raise ValueError(f"unknown contender {contender!r}; choose from {CONTENDERS}")


def sample(contender: str, workers: int, context: str) -> dict[str, float]:
    """One cold and one warm first item, in this (fresh) process."""
    import torch  # noqa: F401  (the user's own imports: the data code needs them)

    from benchmarks import harness
    from benchmarks.workloads._shared import ShardedRange, identity, mapped_range

    settings = harness.Settings(num_workers=workers, context=context, shutdown_limit_s=10.0, reap_grace_s=3.0)

    def first_item() -> float:
        start = time.perf_counter()
        loader = harness.open_loader(
            contender, settings, pipe=mapped_range(ITEMS, identity), dataset=ShardedRange(ITEMS, identity)
        )
        try:
            next(iter(loader))
            return time.perf_counter() - start
        finally:
            harness.close_within(loader, settings)
            harness.end_children(grace_s=settings.reap_grace_s)

    start, cpu = time.perf_counter(), time.process_time()
    _import_loader(contender)
    imports = time.perf_counter() - start
    cold = imports + first_item()
    cold_cpu = time.process_time() - cpu
    return {"cold_first_item": cold, "imports": imports, "cold_main_cpu": cold_cpu, "warm_first_item": first_item()}


def run_sample(contender: str, workers: int, context: str, timeout: float = SAMPLE_TIMEOUT_S) -> dict[str, float]:
    """``sample`` in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # compiling every module each time is no user's cold start
    done = subprocess.run(
        [sys.executable, str(HERE / "startup_cold.py"), "--sample", contender, "--workers", str(workers), "--context", context],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    if done.returncode != 0:
        raise RuntimeError(f"a {contender} sample failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sample", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--samples", type=int, default=9, help="fresh processes per contender and count (default 9)")
    parser.add_argument("--workers", default="2", help="comma-separated worker counts (default 2)")
    parser.add_argument("--context", default="fork", help="start method (default fork)")
    parser.add_argument("--contenders", default="mprs_plus,torch", help=f"comma-separated, from {', '.join(CONTENDERS)}")
    args = parser.parse_args(argv)
    if args.sample:
        print(json.dumps(sample(args.sample, int(args.workers), args.context)))
        return 0
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    counts = [int(n) for n in args.workers.split(",") if n.strip()]
    print(f"first item of a fresh process, ms (medians of {args.samples} fresh processes each, {args.context})")
    header = ["workers"]
    for c in contenders:
        header += [f"{c} cold", f"{c} imports", f"{c} main CPU", f"{c} warm"]
    header += [f"cold vs {c}" for c in contenders[1:]]
    print(" | ".join(header))
    for contender in contenders:
        run_sample(contender, counts[0], args.context)  # untimed: fills the bytecode caches
    for workers in counts:
        rows: dict[str, list[dict[str, float]]] = {c: [] for c in contenders}
        for n in range(args.samples):
            shift = n % len(contenders)
            for contender in contenders[shift:] + contenders[:shift]:
                rows[contender].append(run_sample(contender, workers, args.context))
        med = {c: {k: statistics.median(r[k] for r in found) for k in found[0]} for c, found in rows.items()}
        cells = [str(workers)]
        for c in contenders:
            cells += [f"{med[c][k] * 1e3:.1f}" for k in ("cold_first_item", "imports", "cold_main_cpu", "warm_first_item")]
        mine = med[contenders[0]]["cold_first_item"]
        cells += [f"{mine / med[c]['cold_first_item']:.2f}x" for c in contenders[1:]]
        print(" | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
