"""``num_workers="auto"`` against fixed counts: each case one epoch of ``mprs_plus.DataLoader``
in a fresh interpreter, the workers' start included.

    python benchmarks/auto_workers.py [--workloads sleep,cpu,tiny,pace] [--counts 1,2,4,8] [--scale 1.0] [--repeat 1]

Workloads (map-style datasets, fork, ``seeding="batch"`` for every case so that only the count differs):

    sleep   each sample sleeps 10 ms (storage, the network): more workers than cores pay
    cpu     each sample spins 2 ms on the CPU: the cores bound it
    tiny    each sample an int, batches of 64: the transport and the loop bound it
    pace    0.5 ms of CPU per sample, batches of 32, and a loop that takes 20 ms a step
            (the training step, here a sleep): one worker keeps up

Timed: from the loader's construction to the end of its first epoch (the workers' start
included), and the workers' CPU time (``RUSAGE_CHILDREN`` once they are reaped). For
``pace``: the rate, and the workers' CPU against the smallest fixed count whose rate is
within 5% of the best. The machine's load (``os.getloadavg``) is printed with each row.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (samples, batch size) per workload at scale 1.
SIZES = {"sleep": (3200, 8), "cpu": (3200, 8), "tiny": (400_000, 64), "pace": (9600, 32)}


def _spin(seconds: float) -> None:
    # On this thread's CPU clock, not the wall clock: a worker descheduled mid-spin must
    # still spend the whole CPU time, or more workers than cores would seem to do more work.
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class Work:
    """Sample i of a workload (importable by reference under fork)."""

    def __init__(self, kind: str, n: int) -> None:
        self.kind, self.n = kind, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if self.kind == "sleep":
            time.sleep(0.010)
        elif self.kind == "cpu":
            _spin(0.002)
        elif self.kind == "pace":
            _spin(0.0005)
        return i


def one(kind: str, count: str, scale: float) -> dict[str, float | str]:
    """One case, in this interpreter (the driver starts a fresh one for each)."""
    sys.path.insert(0, str(ROOT))
    import torch  # noqa: F401

    import mprs_plus

    samples, batch = SIZES[kind]
    samples = int(samples * scale)
    workers: int | str = count if count == "auto" else int(count)
    started = time.perf_counter()
    loader = mprs_plus.DataLoader(
        Work(kind, samples), batch_size=batch, num_workers=workers, seeding="batch", multiprocessing_context="fork"
    )
    batches = 0
    for _ in loader:
        batches += 1
        if kind == "pace":
            time.sleep(0.020)
    seconds = time.perf_counter() - started
    chosen = loader._keep.auto.policy.history if count == "auto" else [workers]
    summary = loader.stats().workers_chosen
    del loader, _
    gc.collect()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "workload": kind,
        "count": count,
        "seconds": seconds,
        "batches": batches,
        "rate": batches / seconds,
        "worker_cpu_s": children.ru_utime + children.ru_stime,
        "chosen": " -> ".join(str(c) for c in chosen),
        "why": summary,
        "load": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="sleep,cpu,tiny,pace")
    parser.add_argument("--counts", default="1,2,4,8")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument(
        "--repeat", type=int, default=1,
        help="runs of every case, interleaved (each repetition in another order); the median run is compared",
    )
    parser.add_argument("--one", nargs=2, metavar=("WORKLOAD", "COUNT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1], args.scale)))
        return
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    print(f"cores: {os.cpu_count()}, load before: {os.getloadavg()}")
    for kind in args.workloads.split(","):
        counts = [*args.counts.split(","), "auto"]
        runs: dict[str, list[dict]] = {count: [] for count in counts}
        for rep in range(max(1, args.repeat)):
            shift = rep % len(counts)
            for count in counts[shift:] + counts[:shift]:
                out = subprocess.run(
                    [sys.executable, __file__, "--scale", str(args.scale), "--one", kind, count],
                    env=env, capture_output=True, text=True, timeout=900,
                )
                if out.returncode != 0:
                    print(f"{kind} {count}: failed\n{out.stderr[-2000:]}")
                    continue
                row = json.loads(out.stdout.strip().splitlines()[-1])
                runs[count].append(row)
                print(
                    f"{kind:6} {count:>4}: {row['seconds']:6.2f} s  {row['rate']:8.1f} batches/s  workers' CPU "
                    f"{row['worker_cpu_s']:6.2f} s  chosen {row['chosen']:<12} load {row['load']:.1f}",
                    flush=True,
                )
        rows = [_median_run(runs[count]) for count in counts if runs[count]]
        if args.repeat > 1:
            for row in rows:
                print(f"{kind:6} {row['count']:>4}: median of {len(runs[row['count']])}: {row['seconds']:6.2f} s")
        fixed = [r for r in rows if r["count"] != "auto"]
        auto = next((r for r in rows if r["count"] == "auto"), None)
        if not fixed or auto is None:
            continue
        best = max(fixed, key=lambda r: r["rate"])
        line = f"  {kind}: auto {auto['rate'] / best['rate']:.2f}x the best fixed count ({best['count']})"
        if kind == "pace":
            keeps_up = min((r for r in fixed if r["rate"] >= 0.95 * best["rate"]), key=lambda r: int(r["count"]))
            line += (
                f"; {auto['rate'] / keeps_up['rate']:.2f}x the rate and {auto['worker_cpu_s'] / keeps_up['worker_cpu_s']:.2f}x "
                f"the workers' CPU of the smallest count that keeps up ({keeps_up['count']})"
            )
        print(line)
        print(f"    {auto['why']}")


def _median_run(rows: list[dict]) -> dict:
    """The run of median time (the lower middle one of an even number)."""
    return sorted(rows, key=lambda r: r["seconds"])[(len(rows) - 1) // 2]


if __name__ == "__main__":
    main()
