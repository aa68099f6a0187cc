#!/usr/bin/env python
"""torch's loader API, four implementations, measured interleaved in one run.

    python benchmarks/loader_compare.py             5 repetitions, a few minutes on 2 cores
    python benchmarks/loader_compare.py --quick     each measurement once, with few samples (~1 min)
    python benchmarks/loader_compare.py --stand-in  a dry run: StatefulDataLoader plays mprs_plus
    python benchmarks/loader_compare.py --cheap-samples [--runs N] [--quick]
                                                    cheap samples against num_workers=0, whole
                                                    epochs in fresh processes (cheap_samples.py)
    python benchmarks/loader_compare.py --start-stop [--runs N] [--quick]
                                                    first batch and stop of an iterator against
                                                    torch's DataLoader (start_stop.py)

``mprs_plus.DataLoader`` against torch's ``DataLoader``, torchdata's ``StatefulDataLoader``
and SPDL's ``get_pytorch_dataloader``, each given the same map-style dataset and the same
arguments (batch size, shuffle, 2 workers, the start method): ints, rows of an in-memory
tensor, 1 MiB tensors, 2 ms of Python per sample, JPEG decoding with Pillow, the state taken
after every batch, and the time to the first batch (see ``workloads/loaders.py``).

Interleaved as the suite is (``harness.schedule``): every repetition runs every contender
once per workload, a different one first each time; medians over repetitions. Every
measurement builds its loader anew, is bounded in time, and ends with its loader shut down
and every child process gone (what is left is killed and reported).

Prints one line per target: the medians, the reference the ratio is taken against, the ratio
(above 1: mprs_plus better) and PASS/MISS; writes JSON (every sample, the environment) and
Markdown to benchmarks/results/ or --out DIR. A contender that cannot run (mprs_plus.DataLoader
missing, spdl not installed, a loader that refuses the arguments) is n/a with the reason.
Speed is reported, never asserted: the exit status is non-zero only when the run breaks.

``--cheap-samples`` is a mode of its own (``cheap_samples.py``): mprs_plus.DataLoader against
torch's DataLoader with ``num_workers=0`` on in-memory rows, ints and 1 MiB tensors, each
measurement a whole long epoch in a fresh Python process, min/median/max over ``--runs``
runs with the CPU per sample of the main process and of each worker. It takes ``--runs``,
``--quick``, ``--only`` (rows, ints, tensors), ``--torch-workers``, ``--workers``,
``--context``, ``--out`` and ``--no-progress``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Run as a script, this folder is first on sys.path; import the suite from the repository root.
if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
    sys.path[0] = str(ROOT)
elif str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# torchdata announces its deprecation on import; once is enough.
warnings.filterwarnings("ignore", message=r"\s*#+\s*WARNING!")
# StatefulDataLoader calls a torch function that torch has deprecated, once per loader.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")

from benchmarks import harness  # noqa: E402
from benchmarks.report import Verdict, format_ratio, format_value, ratio  # noqa: E402
from benchmarks.workloads import loaders  # noqa: E402
from benchmarks.workloads._shared import calibrate_loops  # noqa: E402
from benchmarks.workloads.loaders import CONTENDERS, MAIN_COLUMNS, SPDL, Bar  # noqa: E402

JPEG_FILES = 300


def build_parser() -> argparse.ArgumentParser:
    # Building the workloads makes no dataset yet: their names, cheaply.
    names = tuple(w.name for w, _ in loaders.workloads(loaders.OurLoader(None), []))
    parser = argparse.ArgumentParser(
        prog="benchmarks/loader_compare.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="few samples, 1 repetition (about a minute)")
    parser.add_argument(
        "--repetitions", type=int, default=None, help="interleaved repetitions (default 5; 1 with --quick)"
    )
    parser.add_argument(
        "--budget", type=float, default=None, help="seconds of timed streaming per measurement (default 1.5; 0.5 with --quick)"
    )
    parser.add_argument("--workers", type=int, default=2, help="num_workers of every loader (default 2)")
    parser.add_argument(
        "--context",
        default="fork",
        choices=multiprocessing.get_all_start_methods(),
        help="start method of every loader (default fork)",
    )
    parser.add_argument(
        "--only", default=None, metavar="NAMES", help=f"comma-separated workloads, from: {', '.join(names)} (with --cheap-samples: rows, ints, tensors)"
    )
    parser.add_argument(
        "--stand-in",
        action="store_true",
        help="measure torchdata's StatefulDataLoader in mprs_plus's place "
        "(tries the comparison out; its figures say nothing of mprs_plus)",
    )
    parser.add_argument(
        "--out", type=Path, default=HERE / "results", help="output folder (default benchmarks/results)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    cheap = parser.add_argument_group("cheap samples against num_workers=0 (see cheap_samples.py)")
    cheap.add_argument(
        "--cheap-samples",
        action="store_true",
        help="whole epochs of rows, ints and 1 MiB tensors, each in a fresh process, against num_workers=0",
    )
    cheap.add_argument(
        "--runs", type=int, default=None, help="fresh processes per workload and contender (default 5; 1 with --quick)"
    )
    cheap.add_argument("--torch-workers", action="store_true", help="torch's DataLoader with the workers too (slow here)")
    cheap.add_argument(
        "--start-stop",
        action="store_true",
        help="first batch and stop of an iterator, against torch's DataLoader with workers, on the same workloads (start_stop.py)",
    )
    parser.set_defaults(names=names)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.cheap_samples or args.start_stop:
        return _cheap_samples(parser, args)
    if args.runs is not None or args.torch_workers:
        parser.error("--runs and --torch-workers go with --cheap-samples (the comparison takes --repetitions)")
    wanted = args.names
    if args.only:
        wanted = tuple(dict.fromkeys(name.strip() for name in args.only.split(",") if name.strip()))
        unknown = sorted(set(wanted) - set(args.names))
        if unknown or not wanted:
            parser.error(f"unknown workload(s) {unknown}; choose from {list(args.names)}")
    settings = harness.Settings(
        quick=args.quick,
        num_workers=args.workers,
        context=args.context,
        repetitions=args.repetitions or (1 if args.quick else 5),
        budget_s=args.budget or (0.5 if args.quick else 1.5),
        deadline_s=30.0 if args.quick else 90.0,
        shutdown_limit_s=5.0 if args.quick else 10.0,
        reap_grace_s=1.0 if args.quick else 3.0,
        cpu_loops=calibrate_loops(0.002),
    )
    our = loaders.our_loader(stand_in=args.stand_in)
    folder = loaders.JpegFolder(JPEG_FILES) if "jpeg" in wanted else None
    try:
        every = loaders.workloads(our, folder.paths if folder else [])
        selected = [(w, bars) for w, bars in every if w.name in wanted]
        results = run(selected, settings, our, progress=not args.no_progress)
        if folder is not None:  # removed below; the JSON says where it was, so that one can check
            results.environment["jpeg_folder"] = str(folder.path)
    finally:
        if folder is not None:
            folder.close()
    lines = summarize(results, {w.name: bars for w, bars in selected})
    text = table(results, lines)
    print(text)
    kind = ("-quick" if settings.quick else "") + ("-stand-in" if our.stand_in else "")
    stem = f"loaders-{datetime.now():%Y%m%d-%H%M%S}-{settings.context}{kind}"
    paths = write(results, lines, text, args.out, stem)
    print()
    for kind, path in paths.items():
        print(f"{kind:>8}: {path}")
    print(f"    wall: {results.wall_s:.0f} s")
    return 0


def _cheap_samples(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The ``--cheap-samples`` mode, with the options that apply to it."""
    from benchmarks import cheap_samples

    for given, option in ((args.repetitions, "--repetitions"), (args.budget, "--budget"), (args.stand_in, "--stand-in")):
        if given:
            parser.error(f"{option} does not go with --cheap-samples (a whole epoch per fresh process; --runs)")
    if args.runs is not None and args.runs < 1:
        parser.error("--runs must be at least 1")
    only = None
    if args.only:
        only = list(dict.fromkeys(name.strip() for name in args.only.split(",") if name.strip()))
        unknown = sorted(set(only) - set(cheap_samples.WORKLOADS))
        if unknown or not only:
            parser.error(f"unknown workload(s) {unknown}; with --cheap-samples choose from {list(cheap_samples.WORKLOADS)}")
    common = dict(workers=args.workers, context=args.context, quick=args.quick, out=args.out, only=only)
    common["progress"] = not args.no_progress
    if args.start_stop:
        if args.cheap_samples or args.torch_workers:
            parser.error("--start-stop is a mode of its own: torch's DataLoader with workers is its reference")
        from benchmarks import start_stop

        return start_stop.main(runs=args.runs or (1 if args.quick else 9), **common)
    return cheap_samples.main(runs=args.runs or (1 if args.quick else 5), torch_workers=args.torch_workers, **common)


# -- measuring --------------------------------------------------------------------------------


def run(
    selected: list[tuple[harness.Workload, tuple[Bar, ...]]],
    settings: harness.Settings,
    our: loaders.OurLoader,
    progress: bool = True,
) -> harness.Results:
    """Every contender that can run on every selected workload, interleaved; the others n/a."""
    spdl_missing = loaders.spdl_missing()
    missing = {loaders.MPRS_PLUS: our.missing, loaders.MPRS_PLUS_NO_STATE: our.missing, SPDL: spdl_missing}
    workloads = [w for w, _ in selected]

    def note(workload: harness.Workload, contender: str) -> str:
        if contender in workload.runners and missing.get(contender):
            return missing[contender] or ""
        return workload.notes.get(contender, "")

    cells = {w.name: {c: harness.Cell(note=note(w, c)) for c in CONTENDERS} for w in workloads}
    runnable = tuple(c for c in CONTENDERS if not missing.get(c))
    environment = harness.environment(settings)
    environment["versions"]["pillow"] = harness._version("pillow")
    environment["command"] = " ".join(["loader_compare.py", *sys.argv[1:]])
    environment["mprs_plus_class"] = None if our.cls is None else f"{our.cls.__module__}.{our.cls.__qualname__}"
    environment["stand_in"] = our.stand_in
    results = harness.Results(settings, environment, workloads, cells, [])
    steps = harness.schedule(workloads, runnable, settings.repetitions)
    bar = harness._progress(steps, progress)
    started = time.perf_counter()
    for rep, workload, contender in bar:
        label = f"{workload.name} / {contender}" if workload else "memcpy"
        bar.set_postfix_str(f"rep {rep + 1}/{settings.repetitions} {label}")
        if workload is None:
            results.memcpy_gbps.append(harness.memcpy_bandwidth(64 * harness.MiB, 5))
        else:
            # Bounded, then every child process made to end; a refusal is n/a (NotApplicable).
            harness._measure(workload, contender, settings, cells[workload.name][contender])
        results.load_averages.append(os.getloadavg()[0])
    bar.close()
    results.wall_s = time.perf_counter() - started
    results.environment["load_average_end"] = list(os.getloadavg())
    return results


# -- reporting --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Line:
    """One line of the table: a workload's medians and one of its bars, with the ratio."""

    workload: harness.Workload
    bar: Bar
    medians: dict[str, float | None]
    reference: str | None  # the contender the ratio is taken against (the best of bar.against)
    ratio: float | None
    verdict: Verdict | None  # None for a line shown for information

    def as_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload.name,
            "title": self.workload.title,
            "unit": self.workload.metrics[0].unit,
            "medians": self.medians,
            "against": list(self.bar.against),
            "reference": self.reference,
            "ratio": self.ratio,
            "threshold": self.bar.threshold,
            "verdict": self.verdict.word if self.verdict else None,
        }


def summarize(results: harness.Results, bars: dict[str, tuple[Bar, ...]]) -> list[Line]:
    """A line per workload and bar; the ratio above 1 when mprs_plus is better."""
    lines = []
    for workload in results.workloads:
        metric = workload.metrics[0]
        medians = {c: results.cells[workload.name][c].median(metric.key) for c in CONTENDERS}
        for bar in bars[workload.name]:
            measured = [c for c in bar.against if medians[c] is not None]
            # The best reference in the metric's direction: the highest rate, the shortest time.
            reference = (max if metric.higher_is_better else min)(measured, key=lambda c: medians[c]) if measured else None
            value = ratio(metric, medians[loaders.MPRS_PLUS], medians[reference]) if reference else None
            verdict = None
            if bar.threshold is not None:
                verdict = Verdict(harness.Target(metric.key, bar.target, bar.threshold), bar.threshold, value)
            lines.append(Line(workload, bar, medians, reference, value, verdict))
    return lines


def _value(results: harness.Results, workload: harness.Workload, contender: str, median: float | None) -> str:
    """A median as the table shows it (times in ms, as the unit column says), or why none."""
    cell = results.cells[workload.name][contender]
    if cell.status != harness.OK or median is None:
        return cell.status
    unit = workload.metrics[0].unit
    if unit == "s":  # in ms, never in exponents
        return f"{median * 1e3:.0f}" if median >= 0.1 else f"{median * 1e3:.3g}"
    return format_value(median, "items/s" if unit == "samples/s" else unit)


def _rows(results: harness.Results, lines: list[Line]) -> tuple[list[str], list[list[str]]]:
    """The table's cells; a workload's figures on its first line only."""
    header = ["workload", "unit", *MAIN_COLUMNS, "reference", "ratio", "target", "verdict"]
    body, shown = [], set()
    for line in lines:
        workload, first = line.workload, line.workload.name not in shown
        shown.add(workload.name)
        unit = workload.metrics[0].unit
        values = [_value(results, workload, c, line.medians[c]) if first else "" for c in MAIN_COLUMNS]
        if line.reference is None:
            reference = f"{' or '.join(line.bar.against)}: no data"
        else:
            figure = _value(results, workload, line.reference, line.medians[line.reference])
            reference = f"{'best: ' if len(line.bar.against) > 1 else ''}{line.reference} {figure}"
        body.append(
            [
                workload.title if first else "",
                ("ms" if unit == "s" else unit) if first else "",
                *values,
                reference,
                format_ratio(line.ratio),
                line.bar.target,
                line.verdict.word if line.verdict else "(info)",
            ]
        )
    return header, body


def _headline(results: harness.Results) -> str:
    s, env = results.settings, results.environment
    loads = results.load_averages
    load = f"; load average {min(loads):.1f}–{max(loads):.1f}" if loads else ""
    stand_in = ""
    if env.get("stand_in"):
        stand_in = "; STAND-IN: torchdata's StatefulDataLoader plays mprs_plus (a dry run, not mprs_plus's figures)"
    return (
        f"{s.num_workers} workers, {s.context}, {'quick, ' if s.quick else ''}median of {s.repetitions} repetition(s); "
        f"{env['cpu_model']}, {env['usable_cores']} usable cores{load}{stand_in}"
    )


def table(results: harness.Results, lines: list[Line]) -> str:
    header, body = _rows(results, lines)
    out = [f"_{_headline(results)}_", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cells) + " |" for cells in body]
    words = [line.verdict.word for line in lines if line.verdict]
    out += ["", f"targets: {words.count('PASS')} PASS, {words.count('MISS')} MISS, {words.count('NO DATA')} without data"]
    cells = [(w.name, c, cell) for w in results.workloads for c, cell in results.cells[w.name].items()]
    notes = [f"{w} / {c}: {cell.note}" for w, c, cell in cells if cell.note]
    errors = [f"{w} / {c}: {error.splitlines()[0]}" for w, c, cell in cells for error in dict.fromkeys(cell.errors)]
    errors += [
        f"{w} / {c}: left {len(cell.killed_pids)} process(es) running; killed" for w, c, cell in cells if cell.killed_pids
    ]
    out += cpu_table(results)
    if notes:
        out += ["", "Notes:", *(f"- {n}" for n in notes)]
    if errors:
        out += ["", "Problems:", *(f"- {e}" for e in errors)]
    return "\n".join(out)


def cpu_table(results: harness.Results) -> list[str]:
    """CPU microseconds per sample, beside the rate: the main process's and each worker's
    (medians over repetitions), for every steady-state measurement that has them. A worker
    near a whole core per its share of the rate is the limit; one far below it waits."""
    rows = []
    for workload in results.workloads:
        for contender, cell in results.cells[workload.name].items():
            details = [d for d in cell.details if "main_cpu_per_sample" in d]
            if cell.status != harness.OK or not details:
                continue
            main = float(np.median([d["main_cpu_per_sample"] for d in details])) * 1e6
            count = min(len(d["workers_cpu_per_sample"]) for d in details)
            workers = [float(np.median([d["workers_cpu_per_sample"][i] for d in details])) * 1e6 for i in range(count)]
            rate = cell.median("throughput")
            shown = _value(results, workload, contender, rate)
            each = " / ".join(f"{w:.3g}" for w in workers) or "—"
            rows.append(f"| {workload.title} | {contender} | {shown} | {main:.3g} | {each} |")
    if not rows:
        return []
    return [
        "",
        "CPU per sample (µs, over the timed window; medians): the main process, each worker",
        "",
        "| workload | contender | rate | main | workers |",
        "|---|---|---|---|---|",
        *rows,
    ]


def write(results: harness.Results, lines: list[Line], text: str, out: Path, stem: str) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    data = {
        "suite": "mprs_plus benchmarks: torch's loader API",
        "settings": harness.settings_dict(results.settings),
        "environment": results.environment,
        "wall_s": results.wall_s,
        "load_averages": results.load_averages,
        "memcpy": {"samples_gbps": results.memcpy_gbps, "median_gbps": results.memcpy_median()},
        "lines": [line.as_dict() for line in lines],
        "workloads": {
            w.name: {
                "title": w.title,
                "description": w.description,
                "metric": asdict(w.metrics[0]),
                "contenders": {c: asdict(cell) for c, cell in results.cells[w.name].items()},
            }
            for w in results.workloads
        },
    }
    paths = {"json": out / f"{stem}.json", "markdown": out / f"{stem}.md"}
    paths["json"].write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    paths["markdown"].write_text(text + "\n", encoding="utf-8")
    return paths


if __name__ == "__main__":
    sys.exit(main())
