"""The first item of a fresh process, imports included (cold), beside the first item of a
second loader in that process (warm); seconds, lower is better.

    fresh interpreter: user's imports, pipeline -> t0 -> loader's imports -> loader -> first item   cold
                       shutdown; a second loader -> first item                                     warm

A training script pays the cold figure once; the start-up workload, which runs in the
suite's own process where everything is imported already, measures the warm one. Each
sample starts its own interpreter (``benchmarks/startup_cold.py``), so this workload is
left out of ``--quick``.
"""

from __future__ import annotations

import functools
import statistics

from .. import harness, startup_cold

SAMPLES = 3  # fresh processes per repetition and contender
_caches_filled: set[str] = set()


def run(contender: str, settings: harness.Settings) -> dict[str, object]:
    if not settings.quick and contender not in _caches_filled:
        # The first sample compiles and caches bytecode: untimed (a smoke run skips it).
        startup_cold.run_sample(contender, settings.num_workers, settings.context)
        _caches_filled.add(contender)
    samples = [
        startup_cold.run_sample(contender, settings.num_workers, settings.context)
        for _ in range(1 if settings.quick else SAMPLES)
    ]
    return {
        "cold_first_item": statistics.median(s["cold_first_item"] for s in samples),
        "warm_first_item": statistics.median(s["warm_first_item"] for s in samples),
        "imports": statistics.median(s["imports"] for s in samples),
        "cold_main_cpu": statistics.median(s["cold_main_cpu"] for s in samples),
        "samples": samples,
    }


WORKLOAD = harness.Workload(
    name="cold_start",
    title="cold start",
    description="a fresh process: the loader's imports, creating it, its first item (cold); a second loader (warm); seconds",
    metrics=(
        harness.Metric("cold_first_item", "s", higher_is_better=False),
        harness.Metric("warm_first_item", "s", higher_is_better=False),
    ),
    runners={c: functools.partial(run, c) for c in (harness.MPRS_PLUS, harness.TORCHDATA, harness.TORCH)},
    targets=(
        # At most 1.5 times torch's DataLoader, imports included: the ratio (torch's over ours) >= 1/1.5.
        harness.Target("cold_first_item", harness.TORCH, 1 / 1.5),
        harness.Target("warm_first_item", harness.TORCH, 1 / 1.2),
    ),
    notes={harness.IN_PROCESS: "nothing to start"},
    in_quick=False,
    deadline_s=lambda settings: (SAMPLES + 1) * startup_cold.SAMPLE_TIMEOUT_S + 30.0,
)
