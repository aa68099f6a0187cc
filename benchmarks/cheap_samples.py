"""Cheap samples against ``num_workers=0``: whole epochs, each in a fresh Python process.

    python benchmarks/loader_compare.py --cheap-samples              5 runs (default)
    python benchmarks/loader_compare.py --cheap-samples --runs 9     9 runs
    python benchmarks/loader_compare.py --cheap-samples --quick      small epochs, 1 run (a smoke test)
    python benchmarks/loader_compare.py --cheap-samples --only rows  one workload (rows, ints, tensors)

Torch's documentation tells a user with in-memory data to load it in the training process
(``num_workers=0``): a worker's hand-over costs more than it saves. Workers are worth their
processes only when they beat that, so ``mprs_plus.DataLoader`` with 2 workers is measured
against torch's ``DataLoader(num_workers=0)`` on the three workloads of the cheapest samples,
exactly as a user writes them:

    rows     Rows(600_000): torch.randn(600_000, 256), sample i is self.data[i]; batch 128, shuffle=True
    ints     Ints(3_000_000): sample i is i; batch 64
    tensors  FullTensors(16_384): sample i is torch.full((1 << 18,), float(i)), 1 MiB; batch 8; GB/s

(``workloads/loaders.py``), with ``--torch-workers`` torch's ``DataLoader`` with 2 workers as
well (slow on these workloads: it adds about a minute per run).

How one measurement runs (``measure``; the driver starts ``python -m benchmarks.cheap_samples
--measure WORKLOAD CONTENDER`` for each, and reads the JSON line it prints):

    fresh interpreter: imports, the dataset          not timed
    t0 -> build the loader -> first batch: t1        start-up, reported on its own
    t1 -> the epoch's last batch: t2                 the rate: samples after the first batch / (t2 - t1)
    shut the loader down, wait for its workers, kill what is left (reported)

Over t1..t2, the CPU seconds per sample of the main process (``time.process_time``) and of each
of its child processes alive at t1 (psutil's ``cpu_times``; multiprocessing's resource tracker
is no worker and is left out), read every ``LOOK_S`` so that a worker that ends before the
epoch does (its share made) is counted to within ``LOOK_S`` of its end (a look costs the main
process about 50 µs for 2 workers: 0.3% of a core at ``LOOK_S`` = 20 ms). A worker's figure is per sample delivered: a worker that
makes half the samples spends twice it per sample it makes; the workers' sum compares with
the main process's figure under ``num_workers=0``.

The driver bounds every measurement in time (``timeout``), runs it in a process group of its
own and kills whatever of that group outlives it, so no process is left behind. Runs are
interleaved: every run measures every contender once per workload, the order of the
contenders alternating from run to run. It prints min/median/max of every figure and the
ratio of medians (mprs_plus over ``num_workers=0``) against the goals (rows ≥ 1.5x, ints
≥ 1.3x, tensors ≥ 0.6x), and writes JSON (every run's figures, the environment) and Markdown
to benchmarks/results/ or ``--out``.

Figures on a busy machine are worthless. Before each run the driver records the load average,
and over each run the CPU time of every process that is not the run's (``others_cores``: the
machine's busy time less the run's and the driver's, in cores); the output warns when the
load average before the first run, or what other processes took during any run, was above
``QUIET``. The load average before later runs is recorded too, but the benchmark's own earlier
runs raise it (a 1-minute average decays over minutes): it says nothing of other processes.
Under ``num_workers=0`` the main process keeps torch's intra-op threads, as a user's does
(``torch_threads``); when another process holds a core they wait for each other, and
``torch.full`` of 1 MiB then costs milliseconds instead of tens of microseconds.

Modules are compiled first (``compileall``), as an installed package's are, so that a machine
that sets ``PYTHONDONTWRITEBYTECODE`` does not charge compiling to the start-up.
A report, not a test: nothing is asserted, and the exit status is non-zero only when the
run breaks.
"""

from __future__ import annotations

import argparse
import compileall
import json
import math
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # the suite imports from the repository root, however it is started
    sys.path.insert(0, str(ROOT))
# torchdata announces its deprecation on import; once is enough.
warnings.filterwarnings("ignore", message=r"\s*#+\s*WARNING!")

from benchmarks import harness  # noqa: E402
from benchmarks.workloads import loaders  # noqa: E402
from benchmarks.workloads._shared import Ints  # noqa: E402
from benchmarks.workloads.loaders import FullTensors, Rows  # noqa: E402

QUIET = 0.5  # load average, or cores taken by other processes, above which a run was not quiet
LOOK_S = 0.02  # how often the workers' CPU times are read during the epoch

MPRS_PLUS = "mprs_plus"
NO_WORKERS = "no_workers"
TORCH = "torch"
CONTENDERS = (MPRS_PLUS, NO_WORKERS, TORCH)
TITLES = {MPRS_PLUS: "mprs_plus.DataLoader", NO_WORKERS: "DataLoader, num_workers=0", TORCH: "DataLoader"}


@dataclass(frozen=True)
class Workload:
    """One of the issue's workloads: its dataset for a full or a quick run, its batching,
    its unit and the goal on mprs_plus's rate over ``num_workers=0``'s."""

    name: str
    described: str  # with {n}, the samples' count
    batch_size: int
    shuffle: bool
    samples: int
    quick_samples: int
    make: Callable[[int], Any]  # the dataset of that many samples
    sample_bytes: int  # nonzero: the rate is in GB/s
    goal: float

    def size(self, quick: bool) -> int:
        return self.quick_samples if quick else self.samples

    def title(self, quick: bool) -> str:
        return self.described.format(n=self.size(quick))

    @property
    def unit(self) -> str:
        return "GB/s" if self.sample_bytes else "samples/s"


WORKLOADS = {
    w.name: w
    for w in (
        Workload(
            "rows",
            "rows: randn({n:_}, 256), data[i], batch 128, shuffled",
            batch_size=128,
            shuffle=True,
            samples=600_000,
            quick_samples=60_000,
            make=Rows,
            sample_bytes=0,
            goal=1.5,
        ),
        Workload(
            "ints",
            "ints: i, {n:,} samples, batch 64",
            batch_size=64,
            shuffle=False,
            samples=3_000_000,
            quick_samples=300_000,
            make=Ints,
            sample_bytes=0,
            goal=1.3,
        ),
        Workload(
            "tensors",
            "{n:,} x 1 MiB tensors: full((1 << 18,), float(i)), batch 8",
            batch_size=8,
            shuffle=False,
            samples=16_384,  # about a second at the rates of a 2-core machine: start-up a few %
            quick_samples=1_600,
            make=FullTensors,
            sample_bytes=1 << 20,
            goal=0.6,
        ),
    )
}


# -- one measurement, in a fresh process -------------------------------------------------------


def measure(workload: str, contender: str, workers: int, context: str, quick: bool) -> dict[str, Any]:
    """One whole epoch of ``contender`` on ``workload`` in this process (see the module's doc)."""
    spec = WORKLOADS[workload]
    dataset = spec.make(spec.size(quick))
    samples = len(dataset)
    settings = harness.Settings(num_workers=workers, context=context, shutdown_limit_s=10.0, reap_grace_s=3.0)
    our = loaders.our_loader()
    name = {MPRS_PLUS: loaders.MPRS_PLUS, NO_WORKERS: loaders.TORCH_NO_WORKERS, TORCH: loaders.TORCH}[contender]
    if name == loaders.MPRS_PLUS and our.cls is None:
        raise RuntimeError(our.missing)
    expected = math.ceil(samples / spec.batch_size)
    clock, cpu_clock = time.perf_counter, time.process_time

    started = clock()
    loader = loaders.open_loader(name, our, settings, dataset, batch_size=spec.batch_size, shuffle=spec.shuffle)
    try:
        iterator = iter(loader)
        batch = next(iterator)
        first = clock() - started
        children = harness.child_processes()  # the workers; not the resource tracker
        last = dict(_cpu_times(children))
        at_start = dict(last)
        count = 1
        start, cpu_start = clock(), cpu_clock()
        looked = start
        for batch in iterator:
            count += 1
            if children and count & 15 == 0:
                now = clock()
                if now - looked >= LOOK_S:  # a worker may end before the loop does
                    last.update(_cpu_times(children))
                    looked = now
        end, cpu_end = clock(), cpu_clock()
        alive_at_end = dict(_cpu_times(children))
        last.update(alive_at_end)
        del batch  # dropped before the stop, as a training loop drops it
    finally:
        problem = harness.close_within(loader, settings)
        killed = harness.end_children(grace_s=settings.reap_grace_s)
    if count != expected:
        raise RuntimeError(f"the epoch yielded {count} batches, expected {expected}")
    timed = samples - spec.batch_size  # every batch but the first is whole or the last
    rate = timed / (end - start)
    return {
        "samples": samples,
        "samples_timed": timed,
        "epoch_s": end - start,
        "rate": rate * spec.sample_bytes / 1e9 if spec.sample_bytes else rate,
        "samples_per_s": rate,
        "first_batch_s": first,
        "main_cpu_per_sample": (cpu_end - cpu_start) / timed,
        "workers_cpu_per_sample": [(last[pid] - at_start[pid]) / timed for pid in sorted(at_start)],
        "workers_alive_at_end": sum(pid in alive_at_end for pid in at_start),
        "torch_threads": torch.get_num_threads(),  # the main process's intra-op threads
        "problem": problem,
        "killed_pids": killed,
    }


def _cpu_times(processes: list[psutil.Process]) -> list[tuple[int, float]]:
    """CPU seconds (user and system, every thread) of each of ``processes`` still readable."""
    found = []
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        found.append((process.pid, times.user + times.system))
    return found


# -- the driver ----------------------------------------------------------------------------------


def _busy_cpu() -> float:
    """Seconds the machine's CPUs were busy since boot, every core summed."""
    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_one(
    workload: str, contender: str, workers: int, context: str, quick: bool, timeout: float, module: str = "cheap_samples"
) -> dict[str, Any]:
    """``module``'s ``measure`` in a fresh interpreter (``bounded``). Returns its figures, or
    ``error``; with the load average before it and the cores other processes took meanwhile."""
    command = [sys.executable, "-m", f"benchmarks.{module}", "--measure", workload, contender]
    command += ["--workers", str(workers), "--context", context] + (["--quick"] if quick else [])
    record: dict[str, Any] = {"workload": workload, "contender": contender, "load_before": list(os.getloadavg())}
    busy, ours, own, wall = _busy_cpu(), _children_cpu(), time.process_time(), time.perf_counter()
    done = bounded(command, timeout)
    wall = time.perf_counter() - wall
    others = _busy_cpu() - busy - (_children_cpu() - ours) - (time.process_time() - own)
    record["wall_s"] = wall
    record["others_cores"] = max(others, 0.0) / wall
    if done.left_running:
        record["left_running"] = done.left_running
    if done.timed_out:
        record["error"] = f"took longer than {timeout:g} s; killed"
    elif done.returncode != 0:
        record["error"] = f"exit status {done.returncode}: {done.stderr.strip()[-2000:]}"
    else:
        record.update(json.loads(done.stdout.strip().splitlines()[-1]))
    return record


@dataclass(frozen=True)
class Bounded:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    left_running: list[int]  # processes of its group still running after it ended: killed


def bounded(command: list[str], timeout: float) -> Bounded:
    """``command`` from the repository's root, with the repository first on the module path,
    bounded by ``timeout`` and in a process group of its own: the whole group is killed when
    it runs past ``timeout``, and whatever of the group is left when it ends (a worker it did
    not stop) is killed and reported."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # Files, not pipes: a process it leaves behind holds its copy of them open, and reading
    # a pipe to its end would wait for that process too.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)
        timed_out = False
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(process.pid, grace_s=0)
            process.wait(timeout=30)
        except BaseException:  # Ctrl-C reaches the driver only: its own session keeps the group
            _kill_group(process.pid, grace_s=0)
            process.wait(timeout=30)
            raise
        left = _kill_group(process.pid)
        out.seek(0)
        err.seek(0)
        return Bounded(process.returncode, out.read(), err.read(), timed_out, left)


def _kill_group(group: int, grace_s: float = 2.0) -> list[int]:
    """Wait up to ``grace_s`` for every process of the process group ``group`` to end (the
    resource tracker ends on its own once its parent is gone), then kill what is left; the
    ids of the processes killed."""
    members = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == group and process.status() != psutil.STATUS_ZOMBIE:
                members.append(process)
        except (OSError, psutil.Error):
            continue
    _, alive = psutil.wait_procs(members, timeout=grace_s)
    if alive:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
        psutil.wait_procs(alive, timeout=10)
    return [p.pid for p in alive]


def run(
    names: list[str],
    contenders: tuple[str, ...],
    runs: int,
    workers: int,
    context: str,
    quick: bool,
    progress: bool,
    module: str = "cheap_samples",
    shown: Callable[[dict[str, Any]], str] = lambda r: f"{r['rate']:.4g} {WORKLOADS[r['workload']].unit}",
) -> list[dict[str, Any]]:
    """Every run measures every contender once per workload, the contenders' order rotating
    (``module``'s measurement; ``shown``: a record's figure in the progress lines)."""
    timeout = 60.0 if quick else 180.0
    records = []
    for n in range(runs):
        order = contenders[n % len(contenders) :] + contenders[: n % len(contenders)]
        for workload in names:
            for contender in order:
                record = run_one(workload, contender, workers, context, quick, timeout, module)
                record["run"] = n
                records.append(record)
                if progress:
                    figure = record.get("error") or shown(record)
                    print(f"run {n + 1}/{runs} {workload} / {contender}: {figure}", file=sys.stderr, flush=True)
    return records


# -- reporting -----------------------------------------------------------------------------------


def _spread(values: list[float], scale: float = 1.0, digits: int = 3) -> str:
    """min / median / max, or the one value."""
    if not values:
        return "—"
    shown = [min(values), statistics.median(values), max(values)]
    text = [f"{v * scale:.{digits}g}" for v in shown]
    return text[1] if len(values) == 1 else " / ".join(text)


def _rate(value: float, unit: str) -> str:
    if unit == "GB/s":
        return f"{value:.3g}"
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def summarize(records: list[dict[str, Any]], names: list[str], contenders: tuple[str, ...], quick: bool) -> dict[str, Any]:
    """Per workload and contender the figures of the runs that measured, and per workload the
    ratio of the medians of mprs_plus's rate and ``num_workers=0``'s, against the goal."""
    summary: dict[str, Any] = {}
    for name in names:
        spec, cells = WORKLOADS[name], {}
        for contender in contenders:
            ok = [r for r in records if r["workload"] == name and r["contender"] == contender and "error" not in r]
            errors = [r["error"] for r in records if r["workload"] == name and r["contender"] == contender and "error" in r]
            count = min((len(r["workers_cpu_per_sample"]) for r in ok), default=0)
            cells[contender] = {
                "rate": [r["rate"] for r in ok],
                "first_batch_s": [r["first_batch_s"] for r in ok],
                "main_cpu_per_sample": [r["main_cpu_per_sample"] for r in ok],
                "workers_cpu_per_sample": [[r["workers_cpu_per_sample"][i] for r in ok] for i in range(count)],
                "workers_total_cpu_per_sample": [sum(r["workers_cpu_per_sample"]) for r in ok],
                "errors": errors,
            }
        mine, theirs = cells[MPRS_PLUS]["rate"], cells[NO_WORKERS]["rate"]
        ratio = statistics.median(mine) / statistics.median(theirs) if mine and theirs else None
        verdict = "NO DATA" if ratio is None else ("PASS" if ratio >= spec.goal else "MISS")
        summary[name] = {"title": spec.title(quick), "unit": spec.unit, "goal": spec.goal, "ratio": ratio, "verdict": verdict}
        summary[name]["contenders"] = cells
    return summary


def warnings_of(records: list[dict[str, Any]]) -> list[str]:
    """Why these figures may not be worth their digits: a busy machine, broken runs, leftovers."""
    found = []
    if records and records[0]["load_before"][0] > QUIET:
        found.append(
            f"the load average before the first run was {records[0]['load_before'][0]:.2f} (above {QUIET}): "
            "the machine was not quiet; run again on a quiet machine"
        )
    busy = [r for r in records if r["others_cores"] > QUIET]
    if busy:
        worst = max(r["others_cores"] for r in busy)
        found.append(
            f"other processes took more than {QUIET} cores during {len(busy)} of {len(records)} runs "
            f"(up to {worst:.2f}): the machine was not quiet; run again on a quiet machine"
        )
    for r in records:
        where = f"run {r['run'] + 1} {r['workload']} / {r['contender']}"
        if "error" in r:
            found.append(f"{where}: {r['error'].splitlines()[0] if r['error'] else 'failed'}")
        if r.get("left_running") or r.get("killed_pids"):
            found.append(f"{where}: processes outlived it and were killed: {r.get('left_running') or r['killed_pids']}")
        if r.get("problem"):
            found.append(f"{where}: stopping the loader: {r['problem']}")
    return found


def table(summary: dict[str, Any], records: list[dict[str, Any]], headline: str) -> str:
    out = [f"_{headline}_", "", "| workload | `num_workers=0` | `mprs_plus.DataLoader` | ratio of medians | goal | verdict |"]
    out.append("|---|---|---|---|---|---|")
    for s in summary.values():
        rates = {c: s["contenders"][c]["rate"] for c in (NO_WORKERS, MPRS_PLUS)}
        shown = [_rate(statistics.median(v), s["unit"]) if v else "failed" for v in rates.values()]
        ratio = "—" if s["ratio"] is None else f"{s['ratio']:.2f}x"
        out.append(f"| {s['title']} | {shown[0]} | {shown[1]} | {ratio} | ≥ {s['goal']}x | {s['verdict']} |")
    out += [
        "",
        "Each figure min / median / max over the runs. Rate: samples/s (GB/s for tensors) after the first batch;",
        "start-up: building the loader to its first batch, ms; CPU: µs per sample delivered, main process and",
        "each worker (a worker making half the samples spends twice its figure per sample it makes), and the",
        "workers' sum, comparable with the main process's figure under num_workers=0.",
        "",
        "| workload | contender | rate | start-up ms | main CPU µs | worker CPU µs (each) | workers' sum µs |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in summary.values():
        for contender, c in s["contenders"].items():
            if not c["rate"]:
                out.append(f"| {s['title']} | {TITLES[contender]} | failed | | | | |")
                continue
            rate = " / ".join(_rate(v, s["unit"]) for v in (min(c["rate"]), statistics.median(c["rate"]), max(c["rate"])))
            each = "; ".join(_spread(w, 1e6) for w in c["workers_cpu_per_sample"]) or "—"
            total = _spread(c["workers_total_cpu_per_sample"], 1e6) if c["workers_cpu_per_sample"] else "—"
            out.append(
                f"| {s['title']} | {TITLES[contender]} | {rate} {s['unit']} | {_spread(c['first_batch_s'], 1e3)} | "
                f"{_spread(c['main_cpu_per_sample'], 1e6)} | {each} | {total} |"
            )
    problems = warnings_of(records)
    if problems:
        out += ["", "WARNING:", *(f"- {p}" for p in problems)]
    return "\n".join(out)


def headline(records: list[dict[str, Any]], runs: int, workers: int, context: str, quick: bool) -> str:
    loads = [r["load_before"][0] for r in records]
    others = [r["others_cores"] for r in records]
    load = f"; load average before the runs {min(loads):.2f}–{max(loads):.2f}" if loads else ""
    other = f", other processes {max(others):.2f} cores at most" if others else ""
    return (
        f"cheap samples: mprs_plus with {workers} workers against num_workers=0, {context}, "
        f"{'quick, ' if quick else ''}{runs} fresh process(es) each; {harness._cpu_model()}, "
        f"{len(os.sched_getaffinity(0))} usable cores{load}{other}"
    )


def write(data: dict[str, Any], text: str, out: Path, quick: bool, prefix: str = "cheap-samples") -> None:
    """The run's JSON and Markdown into ``out``, named by ``prefix`` and the time; prints where."""
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{prefix}-{datetime.now():%Y%m%d-%H%M%S}{'-quick' if quick else ''}"
    paths = {"json": out / f"{stem}.json", "markdown": out / f"{stem}.md"}
    paths["json"].write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    paths["markdown"].write_text(text + "\n", encoding="utf-8")
    print()
    for kind, path in paths.items():
        print(f"{kind:>8}: {path}")
    print(f"    wall: {data['wall_s']:.0f} s")


def main(
    *,
    runs: int,
    workers: int,
    context: str,
    quick: bool,
    out: Path,
    only: list[str] | None = None,
    torch_workers: bool = False,
    progress: bool = True,
) -> int:
    """The whole mode: compile, run interleaved, print the tables, write JSON and Markdown."""
    names = only or list(WORKLOADS)
    contenders = (MPRS_PLUS, NO_WORKERS, *((TORCH,) if torch_workers else ()))
    compileall.compile_dir(ROOT / "mprs_plus", quiet=1)  # as an installed package's modules are
    started = time.perf_counter()
    records = run(names, contenders, runs, workers, context, quick, progress)
    wall = time.perf_counter() - started
    summary = summarize(records, names, contenders, quick)
    text = table(summary, records, headline(records, runs, workers, context, quick))
    print(text)
    settings = harness.Settings(quick=quick, num_workers=workers, context=context, repetitions=runs)
    environment = harness.environment(settings)
    environment["command"] = " ".join(["loader_compare.py", *sys.argv[1:]])
    environment["load_average_end"] = list(os.getloadavg())
    data = {
        "suite": "mprs_plus benchmarks: cheap samples against num_workers=0, a fresh process per run",
        "settings": {"runs": runs, "workers": workers, "context": context, "quick": quick, "contenders": list(contenders)},
        "environment": environment,
        "wall_s": wall,
        "workloads": summary,
        "runs": records,
        "warnings": warnings_of(records),
    }
    write(data, text, out, quick)
    return 0


def measure_main(argv: list[str], module: str, contenders: tuple[str, ...], measure: Callable[..., dict[str, Any]]) -> int:
    """The entry point of one measurement's fresh process (``python -m benchmarks.<module>
    --measure WORKLOAD CONTENDER``): prints ``measure``'s figures as one JSON line."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{module}")
    parser.add_argument("--measure", nargs=2, metavar=("WORKLOAD", "CONTENDER"), required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--context", default="fork")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    workload, contender = args.measure
    if workload not in WORKLOADS or contender not in contenders:
        parser.error(f"choose a workload from {list(WORKLOADS)} and a contender from {list(contenders)}")
    print(json.dumps(measure(workload, contender, args.workers, args.context, args.quick)))
    return 0


if __name__ == "__main__":
    sys.exit(measure_main(sys.argv[1:], "cheap_samples", CONTENDERS, measure))
