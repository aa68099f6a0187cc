"""Start and stop of an iterator against torch's DataLoader, each sample in a fresh process.

    python benchmarks/loader_compare.py --start-stop                 9 runs (default)
    python benchmarks/loader_compare.py --start-stop --quick         small datasets, 1 run (a smoke test)
    python benchmarks/loader_compare.py --start-stop --only ints     one workload (rows, ints, tensors)

A loop with ``persistent_workers=False`` pays, every epoch, for the start of its workers up
to the first batch and for their stop when the epoch's iterator goes. On the workloads of
``cheap_samples.py`` (rows: 600,000 shuffled rows of a 600 MB tensor; ints: 3,000,000
samples in order; 1 MiB tensors), ``mprs_plus.DataLoader`` and torch's ``DataLoader``, both
with the same workers, are measured in one fresh interpreter per sample:

    imports, the dataset                                         not timed
    iter(loader) -> first batch                                  first batch (the process's first loader)
    50 more batches; del the iterator -> it returns              stop (the workers ended and reaped)
    the same again with a second loader                          next first batch, next stop

The stop is the deletion of the iterator mid-epoch, as a loop that breaks out of its epoch
drops it: both loaders end their workers there and wait for them. The runs interleave the
contenders, the first one alternating, and every figure is given as min / median / max
(``cheap_samples``' driver: each sample bounded in time, in a process group of its own, and
nothing it leaves running survives it). Modules are compiled first, as an installed
package's are. A report, not a test: nothing is asserted.
"""

from __future__ import annotations

import compileall
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import cheap_samples, harness
from benchmarks.cheap_samples import MPRS_PLUS, ROOT, TORCH, TITLES, WORKLOADS, _spread
from benchmarks.workloads import loaders

CONTENDERS = (MPRS_PLUS, TORCH)
BATCHES = 50  # read before each stop: the workers are well into the epoch
FIGURES = ("first_batch_s", "stop_s", "next_first_batch_s", "next_stop_s")
TITLES_OF_FIGURES = {
    "first_batch_s": "first batch",
    "stop_s": "stop",
    "next_first_batch_s": "next loader's first batch",
    "next_stop_s": "its stop",
}


def measure(workload: str, contender: str, workers: int, context: str, quick: bool) -> dict[str, Any]:
    """Two loaders of ``contender`` in this process, each to its first batch, 50 more, and its stop."""
    spec = WORKLOADS[workload]
    dataset = spec.make(spec.size(quick))
    settings = harness.Settings(num_workers=workers, context=context, shutdown_limit_s=10.0, reap_grace_s=3.0)
    our = loaders.our_loader()
    name = {MPRS_PLUS: loaders.MPRS_PLUS, TORCH: loaders.TORCH}[contender]
    figures: dict[str, Any] = {}
    clock = time.perf_counter
    for prefix in ("", "next_"):
        wrapper = loaders.open_loader(name, our, settings, dataset, batch_size=spec.batch_size, shuffle=spec.shuffle)
        try:
            started = clock()
            iterator = iter(wrapper.loader)
            batch = next(iterator)
            figures[prefix + "first_batch_s"] = clock() - started
            for _ in range(BATCHES):
                batch = next(iterator)
            del batch
            started = clock()
            del iterator  # both loaders end and reap their workers here
            figures[prefix + "stop_s"] = clock() - started
        finally:
            problem = harness.close_within(wrapper, settings)
            killed = harness.end_children(grace_s=settings.reap_grace_s)
        if problem or killed:
            figures["problem"] = f"{problem or ''} killed: {killed}".strip()
    return figures


def table(records: list[dict[str, Any]], names: list[str], headline: str, quick: bool) -> str:
    out = [f"_{headline}_", "", "ms, min / median / max over the runs", ""]
    out.append("| workload | contender | " + " | ".join(TITLES_OF_FIGURES[f] for f in FIGURES) + " |")
    out.append("|---|---|" + "---|" * len(FIGURES))
    for name in names:
        for contender in CONTENDERS:
            ok = [r for r in records if r["workload"] == name and r["contender"] == contender and "error" not in r]
            cells = [_spread([r[f] for r in ok], 1e3) for f in FIGURES] if ok else ["failed"] * len(FIGURES)
            out.append(f"| {WORKLOADS[name].title(quick)} | {TITLES[contender]} | " + " | ".join(cells) + " |")
    problems = cheap_samples.warnings_of([{**r, "killed_pids": r.get("left_running")} for r in records])
    if problems:
        out += ["", "WARNING:", *(f"- {p.splitlines()[0]}" for p in problems)]
    return "\n".join(out)


def main(*, runs: int, workers: int, context: str, quick: bool, out: Path, only: list[str] | None = None, progress: bool = True) -> int:
    names = only or list(WORKLOADS)
    compileall.compile_dir(ROOT / "mprs_plus", quiet=1)  # as an installed package's modules are
    started = time.perf_counter()
    records = cheap_samples.run(
        names, CONTENDERS, runs, workers, context, quick, progress, "start_stop", lambda r: f"stop {r['stop_s'] * 1e3:.1f} ms"
    )
    wall = time.perf_counter() - started
    headline = (
        f"start and stop: mprs_plus against torch's DataLoader, {workers} workers each, {context}, "
        f"{'quick, ' if quick else ''}{runs} fresh process(es) each; {harness._cpu_model()}"
    )
    text = table(records, names, headline, quick)
    print(text)
    medians = {
        name: {
            contender: {
                f: statistics.median(v)
                for f in FIGURES
                if (v := [r[f] for r in records if r["workload"] == name and r["contender"] == contender and "error" not in r])
            }
            for contender in CONTENDERS
        }
        for name in names
    }
    data = {
        "suite": "mprs_plus benchmarks: start and stop of an iterator, a fresh process per run",
        "settings": {"runs": runs, "workers": workers, "context": context, "quick": quick, "batches_before_stop": BATCHES},
        "environment": harness.environment(harness.Settings(quick=quick, num_workers=workers, context=context)),
        "wall_s": wall,
        "medians": medians,
        "runs": records,
    }
    cheap_samples.write(data, text, out, quick, prefix="start-stop")
    return 0


if __name__ == "__main__":
    sys.exit(cheap_samples.measure_main(sys.argv[1:], "start_stop", CONTENDERS, measure))
