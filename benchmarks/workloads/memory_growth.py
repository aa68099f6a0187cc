"""Resident memory of the workers while streaming a large volume of 1 MiB arrays.

    after a warm-up: baseline RSS of each worker -> stream -> peak RSS of each worker
    reported: the largest growth of any worker, in MiB, against a bound

A leak of a few bytes per item, or a buffer that grows with the volume streamed, shows
up here and nowhere else. Not part of ``--quick``; one repetition per run.
"""

from __future__ import annotations

import functools
import time

import psutil

from .. import harness
from ._shared import mapped_range, numpy_array


def _rss(process: psutil.Process) -> int:
    try:
        return process.memory_info().rss
    except psutil.NoSuchProcess:
        return 0


def run(settings: harness.Settings) -> dict[str, object]:
    n = max(100, round(settings.memory_gb * harness.GB / harness.MiB))
    warm = max(50, n // 20)
    sample_every = 64
    fn = functools.partial(numpy_array, nbytes=harness.MiB)
    loader = harness.open_loader(harness.MPRS_PLUS, settings, pipe=mapped_range(n, fn))
    baseline: dict[int, int] = {}
    peak: dict[int, int] = {}
    workers: list[psutil.Process] = []
    count = 0
    start = time.perf_counter()
    try:
        for count, _ in enumerate(loader, 1):
            if count == warm:
                workers = harness.child_processes()
                baseline = {p.pid: _rss(p) for p in workers}
                peak = dict(baseline)
                start = time.perf_counter()
            elif count > warm and count % sample_every == 0:
                for p in workers:
                    peak[p.pid] = max(peak[p.pid], _rss(p))
        elapsed = time.perf_counter() - start
    finally:
        problem = harness.close_within(loader, settings)
    if count != n:
        raise RuntimeError(f"the epoch yielded {count} items, expected {n}")
    if not workers:
        raise RuntimeError("no worker process found to watch")
    growth = {pid: (peak[pid] - baseline[pid]) / harness.MiB for pid in baseline}
    return {
        "problems": [problem] if problem else [],
        "rss_growth": max(growth.values()),
        "throughput": (n - warm) * harness.MiB / elapsed / harness.GB,
        "streamed_gb": n * harness.MiB / harness.GB,
        "baseline_rss_mib": sorted(round(v / harness.MiB, 1) for v in baseline.values()),
        "peak_rss_mib": sorted(round(v / harness.MiB, 1) for v in peak.values()),
    }


def _deadline(settings: harness.Settings) -> float:
    # Generous: even at 0.1 GB/s the whole volume fits.
    return max(settings.deadline_s, settings.memory_gb / 0.1)


WORKLOAD = harness.Workload(
    name="memory_growth",
    title="worker memory",
    description="RSS growth of each worker while streaming --memory-gb of 1 MiB arrays; MiB (and GB/s)",
    metrics=(
        harness.Metric("rss_growth", "MiB", higher_is_better=False),
        harness.Metric("throughput", "GB/s"),
    ),
    runners={harness.MPRS_PLUS: run},
    targets=(harness.Target("rss_growth", None, 64.0, threshold_setting="memory_bound_mib"),),
    notes={c: "measured for mprs_plus only" for c in (harness.TORCHDATA, harness.TORCH, harness.IN_PROCESS, harness.SPDL)},
    in_quick=False,
    max_repetitions=1,
    deadline_s=_deadline,
)
