#!/usr/bin/env python
"""mprs_plus on a Ray cluster, beside local mprs_plus and Ray Data, measured interleaved.

    python -m benchmarks.ray_compare            5 repetitions
    python -m benchmarks.ray_compare --quick    each measurement once, with few items
    python benchmarks/ray_compare.py --help     the same script; --only, --contenders, ...

Three workloads (tiny items, 1 MiB numpy arrays, 2 ms of CPU work per item) through five
contenders: ``mprs_plus-ray`` (the service with ``backend=RayBackend(...)``: its two workers
are Ray actors on the other node, their items come over streams), ``mprs_plus-ray-near``
(the same, both actors on the training process's node: shared-memory rings),
``mprs_plus-ray-warm`` (as ``mprs_plus-ray``, its actors warm: an untimed loader before
the timed one started them, as an earlier epoch or loader of the driver would),
``mprs_plus`` (two local worker processes) and ``ray-data`` (``ray.data.range(n).map(...)``,
read with ``iter_rows()``). The Ray contenders run on a simulated two-node cluster started
once for the run (``ray.cluster_utils.Cluster``, one CPU per node, the Ray backend's two
actors half a CPU each on one node); its start-up is reported on its own, not in any
contender's figures.

Every measurement streams one whole epoch from a new loader (``ray_cluster.stream_epoch``
says why never a part of one). Reported per workload and contender: items/s in steady
state and over the whole epoch (start-up included), GB/s (arrays), the main process's CPU
time per item (every thread of it: Ray's driver threads count) and the time from creating
the loader to its first item. Interleaved as the suite is (``harness.schedule``): every
repetition runs every contender once per workload, a different one first each time.

Then what a start costs (``workloads/ray_startup.py``): two epochs of
``persistent_workers=False`` and five loaders one after another, with warm actors (the
default), without them (``warm_for=0``) and Ray Data: each epoch's time to its first batch.
``--startup-repetitions 0`` leaves it out.

Without Ray the Ray contenders are n/a, saying why; so are the ``mprs_plus-ray`` rows while
``mprs_plus.RayBackend`` is not importable. Speed is reported, never asserted: the exit
status is non-zero only when the comparison itself breaks.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import warnings
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Run as a script, this folder is first on sys.path; import the suite from the repository root.
if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
    sys.path[0] = str(ROOT)
elif str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

warnings.filterwarnings("ignore", message=r"\s*#+\s*WARNING!")

import numpy as np  # noqa: E402
import psutil  # noqa: E402

from benchmarks import harness  # noqa: E402
from benchmarks.report import format_value  # noqa: E402
from benchmarks.workloads import ray_cluster  # noqa: E402
from benchmarks.workloads._shared import calibrate_loops  # noqa: E402
from benchmarks.workloads.ray_cluster import (  # noqa: E402
    CONTENDERS,
    RAY_BACKEND,
    RAY_BACKENDS,
    RAY_CONTENDERS,
    RAY_DATA,
    RAY_NEAR,
    RAY_WARM,
)


def build_parser() -> argparse.ArgumentParser:
    names = [c.name for c in ray_cluster.CASES]
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.ray_compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="few items, 1 repetition")
    parser.add_argument("--repetitions", type=int, default=None, help="interleaved repetitions (default 5; 1 with --quick)")
    parser.add_argument("--workers", type=int, default=2, help="workers of both mprs_plus contenders (default 2)")
    parser.add_argument("--only", default=None, metavar="NAMES", help=f"comma-separated workloads, from: {', '.join(names)}")
    parser.add_argument(
        "--contenders", default=",".join(CONTENDERS), metavar="NAMES", help=f"comma-separated, from: {', '.join(CONTENDERS)}"
    )
    parser.add_argument(
        "--startup-repetitions", type=int, default=None, metavar="N",
        help="repetitions of the start-up sequences (default 3; 0 with --quick: none)",
    )
    parser.add_argument("--out", type=Path, default=HERE / "results", help="output folder (default benchmarks/results)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _names(text: str | None, known: tuple[str, ...], what: str, parser: argparse.ArgumentParser) -> tuple[str, ...]:
    if text is None:
        return known
    wanted = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = sorted(set(wanted) - set(known))
    if unknown or not wanted:
        parser.error(f"unknown {what} {unknown}; choose from {list(known)}")
    return tuple(name for name in known if name in wanted)  # canonical order


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    case_names = _names(args.only, tuple(c.name for c in ray_cluster.CASES), "workload(s)", parser)
    contenders = _names(args.contenders, CONTENDERS, "contender(s)", parser)
    settings = harness.Settings(
        quick=args.quick,
        num_workers=args.workers,
        context="fork",
        repetitions=args.repetitions or (1 if args.quick else 5),
        # Ray Data's first execution starts its workers: tens of seconds on a loaded machine.
        deadline_s=90.0 if args.quick else 180.0,
        shutdown_limit_s=15.0,
        reap_grace_s=3.0,
        cpu_loops=calibrate_loops(0.002),
    )
    backend_missing = ray_cluster.ray_backend_missing()
    missing = {
        RAY_BACKEND: backend_missing,
        RAY_NEAR: backend_missing,
        RAY_WARM: backend_missing,
        RAY_DATA: ray_cluster.ray_missing(),
    }
    stamp = f"{datetime.now():%Y%m%d-%H%M%S}"
    cluster = None
    if any(c in contenders and not missing[c] for c in RAY_CONTENDERS):
        cluster = ray_cluster.LocalCluster().start()
    startup_reps = args.startup_repetitions if args.startup_repetitions is not None else (0 if args.quick else 3)
    startup: dict[str, Any] | None = None
    try:
        cases = tuple(c for c in ray_cluster.CASES if c.name in case_names)
        results = run(ray_cluster.workloads(cluster, cases), settings, contenders, missing, cluster, not args.no_progress)
        if cluster is not None and startup_reps > 0 and not missing[RAY_BACKEND]:
            from benchmarks.workloads import ray_startup

            startup = ray_startup.measure(cluster, startup_reps, settings)
            startup["rows"] = ray_startup.rows(startup)
            startup["table"] = ray_startup.table(startup)
            startup["load_average_end"] = list(os.getloadavg())
    finally:
        if cluster is not None:
            cluster.stop()
    if cluster is not None:
        # Every process of the cluster ends with its shutdown; one that does not is reported.
        results.environment["cluster_left_running"] = end_new_children(set(), settings.reap_grace_s)
    text = table(results)
    if startup is not None:
        results.environment["startup"] = {k: v for k, v in startup.items() if k != "table"}
        text += "\n\n" + startup["table"]
    print(text)
    paths = write(results, text, args.out, f"ray-{stamp}{'-quick' if args.quick else ''}")
    print()
    for kind, path in paths.items():
        print(f"{kind:>8}: {path}")
    print(f"    wall: {results.wall_s:.0f} s")
    return 0


# -- measuring --------------------------------------------------------------------------------


def run(
    workloads: list[harness.Workload],
    settings: harness.Settings,
    contenders: tuple[str, ...],
    missing: dict[str, str | None],
    cluster: ray_cluster.LocalCluster | None,
    progress: bool = True,
) -> harness.Results:
    """Every selected contender on every workload, interleaved; an unavailable one is n/a."""

    def note(contender: str) -> str:
        if contender not in contenders:
            return "not selected in this run"
        return missing.get(contender) or ""

    cells = {w.name: {c: harness.Cell(note=note(c)) for c in CONTENDERS} for w in workloads}
    runnable = tuple(c for c in contenders if not missing.get(c))
    environment = harness.environment(settings)
    environment["versions"]["ray"] = harness._version("ray")
    environment["command"] = " ".join(["ray_compare", *sys.argv[1:]])
    if cluster is not None:
        environment["cluster"] = cluster.describe()
        environment["cluster_start_s"] = round(cluster.start_s, 2)
    results = harness.Results(settings, environment, workloads, cells, [])
    steps = harness.schedule(workloads, runnable, settings.repetitions) if runnable else []
    bar = harness._progress(steps, progress)
    started = time.perf_counter()
    for rep, workload, contender in bar:
        bar.set_postfix_str(f"rep {rep + 1}/{settings.repetitions} {workload.name if workload else 'memcpy'} / {contender}")
        if workload is None:
            results.memcpy_gbps.append(harness.memcpy_bandwidth(64 * harness.MiB, 5))
        else:
            measure(workload, contender, settings, cells[workload.name][contender], cluster)
        results.load_averages.append(os.getloadavg()[0])
    bar.close()
    results.wall_s = time.perf_counter() - started
    results.environment["load_average_end"] = list(os.getloadavg())
    return results


def measure(
    workload: harness.Workload,
    contender: str,
    settings: harness.Settings,
    cell: harness.Cell,
    cluster: ray_cluster.LocalCluster | None,
) -> None:
    """One measurement, as ``harness`` makes it, with leftovers checked without touching the
    cluster: new local processes must end (else they are killed and reported), and a Ray
    contender must give every CPU of the cluster back."""
    try:
        with harness.deadline(settings.deadline_s):
            values = dict(workload.runners[contender](settings))
    except Exception as exc:
        cell.errors.append(harness.describe(exc))
        if cell.status != harness.OK:
            cell.status = harness.FAILED
    else:
        cell.status = harness.OK
        for metric in workload.metrics:
            cell.samples.setdefault(metric.key, []).append(float(values.pop(metric.key)))
        cell.errors += [f"(figures kept) {problem}" for problem in values.pop("problems", [])]
        cell.details.append(values)
    finally:
        gc.collect()
        cell.killed_pids += end_new_children(cluster.processes() if cluster else set(), settings.reap_grace_s)
        if contender in RAY_CONTENDERS and cluster is not None:
            problem = cluster.idle_within(settings.shutdown_limit_s)
            if problem:
                cell.errors.append(problem)


def end_new_children(cluster_pids: set[int], grace_s: float) -> list[int]:
    """``harness.end_children`` for the processes that are not the cluster's: wait up to
    ``grace_s`` for them to end, kill the rest, and return the ids of those killed."""
    deadline_at = time.monotonic() + grace_s
    alive = _new_children(cluster_pids)
    while alive and time.monotonic() < deadline_at:
        time.sleep(0.05)  # not a synchronisation: a bounded look at processes we do not own
        alive = [p for p in alive if harness._running(p)]
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    return [p.pid for p in alive]


def _new_children(cluster_pids: set[int]) -> list[psutil.Process]:
    found = []
    for child in psutil.Process().children(recursive=False):
        if child.pid in cluster_pids:
            continue  # the cluster's daemons and, below them, its workers
        try:
            tree = [child, *child.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        found += [p for p in tree if harness._running(p) and not harness._is_session_helper(p)]
    return found


# -- reporting --------------------------------------------------------------------------------


def rows(results: harness.Results) -> list[dict[str, Any]]:
    """One row per workload and contender: medians, and the Ray backend's ratios."""
    out = []
    for workload in results.workloads:
        cells = results.cells[workload.name]
        nbytes = ray_cluster.item_bytes(workload.name)
        medians = {c: {m.key: cells[c].median(m.key) for m in workload.metrics} for c in CONTENDERS}
        for contender in CONTENDERS:
            cell, median = cells[contender], medians[contender]
            rate = median["throughput"]
            row = {
                "workload": workload.name,
                "title": workload.title,
                "contender": contender,
                "status": cell.status,
                "note": cell.note,
                "items_per_s": rate,
                "epoch_items_per_s": median["epoch_throughput"],
                "gbps": rate * nbytes / harness.GB if rate is not None and nbytes else None,
                "main_cpu_us_per_item": _scaled(median["main_cpu_per_item"], 1e6),
                "first_item_ms": _scaled(median["first_item"], 1e3),
            }
            # The bar: the Ray backend against Ray Data (throughput, and main CPU).
            if contender in RAY_BACKENDS:
                theirs = medians[RAY_DATA]
                row["throughput_vs_ray_data"] = _ratio(rate, theirs["throughput"])
                row["epoch_throughput_vs_ray_data"] = _ratio(median["epoch_throughput"], theirs["epoch_throughput"])
                row["main_cpu_vs_ray_data"] = _ratio(median["main_cpu_per_item"], theirs["main_cpu_per_item"])
            out.append(row)
    return out


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def _ratio(mine: float | None, theirs: float | None) -> float | None:
    return mine / theirs if mine and theirs else None


def _text(value: float | None, unit: str, status: str) -> str:
    if status != harness.OK:
        return status
    if value is None:
        return "—"
    if unit in ("items/s", "GB/s"):
        return format_value(value, unit)
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"  # µs or ms: no exponents


def table(results: harness.Results) -> str:
    header = [
        "workload",
        "contender",
        "items/s",
        "GB/s",
        "epoch items/s",
        "main CPU µs/item",
        "first item ms",
        "÷ ray-data: items/s, epoch, main CPU",
    ]
    body = []
    for row in rows(results):
        vs = ""
        if row["contender"] in RAY_BACKENDS and row["status"] == harness.OK:
            keys = ("throughput_vs_ray_data", "epoch_throughput_vs_ray_data", "main_cpu_vs_ray_data")
            parts = [f"{row[k]:.3g}×" if row[k] is not None else "—" for k in keys]
            vs = ", ".join(parts)
        body.append(
            [
                row["title"],
                row["contender"],
                _text(row["items_per_s"], "items/s", row["status"]),
                _text(row["gbps"], "GB/s", row["status"]),
                _text(row["epoch_items_per_s"], "items/s", row["status"]),
                _text(row["main_cpu_us_per_item"], "", row["status"]),
                _text(row["first_item_ms"], "", row["status"]),
                vs,
            ]
        )
    lines = [_headline(results), "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    cells = [(w.name, c, cell) for w in results.workloads for c, cell in results.cells[w.name].items()]
    notes = sorted({f"{c}: {cell.note}" for _, c, cell in cells if cell.note})
    errors = [f"{w} / {c}: {error.splitlines()[0]}" for w, c, cell in cells for error in dict.fromkeys(cell.errors)]
    errors += [
        f"{w} / {c}: left {len(cell.killed_pids)} process(es) running; killed" for w, c, cell in cells if cell.killed_pids
    ]
    left = results.environment.get("cluster_left_running")
    if left:
        errors.append(f"the cluster left {len(left)} process(es) running after its shutdown; killed")
    if notes:
        lines += ["", "Notes:", *(f"- {n}" for n in notes)]
    if errors:
        lines += ["", "Problems:", *(f"- {e}" for e in errors)]
    return "\n".join(lines)


def _headline(results: harness.Results) -> str:
    s, env = results.settings, results.environment
    loads = results.load_averages
    load = f"; load average {min(loads):.1f}–{max(loads):.1f}" if loads else ""
    cluster = f"; {env['cluster']}, started in {env['cluster_start_s']:.1f} s" if "cluster" in env else ""
    memcpy = results.memcpy_median()
    return (
        f"{s.num_workers} workers, {'quick, ' if s.quick else ''}median of {s.repetitions} repetition(s); "
        f"{env['cpu_model']}, {env['usable_cores']} usable cores{load}{cluster}; "
        f"ray {env['versions'].get('ray')}; single-core memcpy {f'{memcpy:.1f} GB/s' if memcpy else '—'}"
    )


def write(results: harness.Results, text: str, out: Path, stem: str) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    data = {
        "settings": harness.settings_dict(results.settings),
        "environment": results.environment,
        "wall_s": results.wall_s,
        "load_averages": results.load_averages,
        "memcpy": {"samples_gbps": results.memcpy_gbps, "median_gbps": results.memcpy_median()},
        "rows": rows(results),
        "workloads": {
            w.name: {
                "title": w.title,
                "description": w.description,
                "item_bytes": ray_cluster.item_bytes(w.name),
                "contenders": {
                    c: {k: v for k, v in asdict(cell).items()} for c, cell in results.cells[w.name].items()
                },
            }
            for w in results.workloads
        },
    }
    paths = {"json": out / f"{stem}.json", "markdown": out / f"{stem}.md"}
    paths["json"].write_text(json.dumps(data, indent=1, default=_jsonable), encoding="utf-8")
    paths["markdown"].write_text(text + "\n", encoding="utf-8")
    return paths


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
