"""What a start costs on Ray: epochs of ``persistent_workers=False`` and loaders one after
another in one driver, each epoch's time to its first batch, beside Ray Data's.

    two_epochs     one loader, two epochs of persistent_workers=False (new workers each)
    five_loaders   five loaders one after another, one epoch each

Each sequence reads ``ITEMS`` ints in batches of ``BATCH`` with two workers, on the
comparison's two-node cluster (``ray_cluster.LocalCluster``):

* ``mprs_plus-ray-warm``: ``mprs_plus.DataLoader(..., backend=RayBackend(...))``, the
  actors on the other node; an epoch's or a loader's actors wait for the next one
  (``RayBackend.warm_for``, the default);
* ``mprs_plus-ray-cold``: the same with ``warm_for=0``: new actors every epoch and loader;
* ``ray-data``: ``ray.data.range(ITEMS)`` read with ``iter_batches(batch_size=BATCH)``,
  the same dataset twice (two epochs) or a new one each time (five loaders).

Every sequence starts with no actor of its own on the cluster (the warm one's end with
``RayBackend.close()`` after it), so its first epoch pays a whole start and the next ones
show what is paid again. Figures per epoch: seconds to its first batch (from creating the
loader, or from asking for the epoch's iterator) and to its last.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .. import harness
from ._shared import Ints
from .ray_cluster import OTHER_NODE, LocalCluster

ITEMS = 2_000
BATCH = 64
WARM, COLD, RAY_DATA = "mprs_plus-ray-warm", "mprs_plus-ray-cold", "ray-data"
CONTENDERS = (WARM, COLD, RAY_DATA)
SEQUENCES = {"two_epochs": (1, 2), "five_loaders": (5, 1)}  # name: (loaders, epochs each)
TITLES = {
    "two_epochs": "two epochs, persistent_workers=False",
    "five_loaders": "five loaders one after another",
}


def _epoch(batches: Any, started: float) -> tuple[float, float, int]:
    """Read one epoch: (seconds to the first batch, to the last, items) from ``started``."""
    clock = time.perf_counter
    first, items = None, 0
    for batch in batches:
        if first is None:
            first = clock() - started
        items += len(batch) if not isinstance(batch, dict) else len(next(iter(batch.values())))
    return (first if first is not None else float("nan")), clock() - started, items


def run_mprs(cluster: LocalCluster, loaders: int, epochs: int, warm_for: float, workers: int = 2) -> list[tuple[float, float]]:
    import mprs_plus

    share = 1.0 / workers
    backend = mprs_plus.RayBackend(
        address=cluster.address, num_cpus_per_worker=share, resources={OTHER_NODE: share}, warm_for=warm_for
    )
    out = []
    try:
        for _ in range(loaders):
            created = time.perf_counter()
            loader = mprs_plus.DataLoader(Ints(ITEMS), batch_size=BATCH, num_workers=workers, backend=backend)
            for epoch in range(epochs):
                first, last, items = _epoch(loader, created if epoch == 0 else time.perf_counter())
                if items != ITEMS:
                    raise RuntimeError(f"an epoch yielded {items} items, expected {ITEMS}")
                out.append((first, last))
            del loader
    finally:
        backend.close()
    return out


def run_ray_data(loaders: int, epochs: int) -> list[tuple[float, float]]:
    import ray.data

    out = []
    for _ in range(loaders):
        created = time.perf_counter()
        dataset = ray.data.range(ITEMS)
        for epoch in range(epochs):
            first, last, items = _epoch(dataset.iter_batches(batch_size=BATCH), created if epoch == 0 else time.perf_counter())
            if items != ITEMS:
                raise RuntimeError(f"an epoch yielded {items} items, expected {ITEMS}")
            out.append((first, last))
    return out


def runner(contender: str, cluster: LocalCluster) -> Callable[[int, int], list[tuple[float, float]]]:
    if contender == WARM:
        return lambda loaders, epochs: run_mprs(cluster, loaders, epochs, warm_for=60.0)
    if contender == COLD:
        return lambda loaders, epochs: run_mprs(cluster, loaders, epochs, warm_for=0.0)
    if contender == RAY_DATA:
        return run_ray_data
    raise ValueError(f"unknown contender {contender!r}; choose from {CONTENDERS}")


def measure(cluster: LocalCluster, repetitions: int, settings: harness.Settings) -> dict[str, Any]:
    """Every sequence by every contender, ``repetitions`` times, interleaved (a different
    contender first each repetition). Returns {sequence: {contender: [[(first, last)] per
    epoch] per repetition]}, and the problems met."""
    samples: dict[str, dict[str, list[list[tuple[float, float]]]]] = {s: {c: [] for c in CONTENDERS} for s in SEQUENCES}
    problems: list[str] = []
    for rep in range(repetitions):
        order = CONTENDERS[rep % len(CONTENDERS):] + CONTENDERS[: rep % len(CONTENDERS)]
        for sequence, (loaders, epochs) in SEQUENCES.items():
            for contender in order:
                try:
                    with harness.deadline(settings.deadline_s * max(loaders, epochs)):
                        samples[sequence][contender].append(runner(contender, cluster)(loaders, epochs))
                except Exception as exc:
                    problems.append(f"{sequence} / {contender}: {harness.describe(exc).splitlines()[0]}")
                problem = cluster.idle_within(settings.shutdown_limit_s)
                if problem:
                    problems.append(f"{sequence} / {contender}: {problem}")
    return {"samples": samples, "problems": problems}


def _median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v == v)
    if not values:
        return None
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def rows(measured: dict[str, Any]) -> list[dict[str, Any]]:
    """Per sequence and contender: the median of each epoch's first batch and last batch."""
    out = []
    for sequence, by_contender in measured["samples"].items():
        for contender, reps in by_contender.items():
            if not reps:
                out.append({"sequence": sequence, "contender": contender, "first_batch_ms": [], "epoch_ms": []})
                continue
            count = min(len(r) for r in reps)
            first = [_median([r[i][0] for r in reps]) for i in range(count)]
            last = [_median([r[i][1] for r in reps]) for i in range(count)]
            out.append(
                {
                    "sequence": sequence,
                    "contender": contender,
                    "repetitions": len(reps),
                    "first_batch_ms": [None if v is None else v * 1e3 for v in first],
                    "epoch_ms": [None if v is None else v * 1e3 for v in last],
                }
            )
    return out


def table(measured: dict[str, Any]) -> str:
    def ms(values: list[float | None]) -> str:
        return ", ".join("—" if v is None else f"{v:,.0f}" for v in values) or "failed"

    lines = [
        f"Start-up: {ITEMS:,} ints, batch {BATCH}, 2 workers; medians; ms per epoch, in order "
        "(an epoch's first batch counts from creating its loader, or from asking for its iterator)",
        "",
        "| sequence | contender | first batch ms | last batch ms |",
        "|---|---|---|---|",
    ]
    for row in rows(measured):
        lines.append(f"| {TITLES[row['sequence']]} | {row['contender']} | {ms(row['first_batch_ms'])} | {ms(row['epoch_ms'])} |")
    if measured["problems"]:
        lines += ["", "Problems:", *(f"- {p}" for p in measured["problems"])]
    return "\n".join(lines)
