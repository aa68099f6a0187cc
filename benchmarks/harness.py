"""Measuring machinery shared by every workload: contenders, timing, interleaving, metadata.

    run.py -> run_suite(workloads, settings)
                 for each repetition: memcpy probe, then every workload, contenders in rotated order
                     measure(workload, contender)      one fresh loader: open -> stream -> close,
                                                       then every child process is made to end
              -> Results (every sample, every error) -> report.py (table, JSON, plot)

Why it is built this way:

* **Interleaved.** Repetitions go round-robin over the contenders, and the contender that
  goes first rotates, so load from elsewhere on the machine and slow drift hit every
  contender alike. Medians over repetitions are reported.
* **Isolated.** Every measurement builds its loader from scratch and shuts it down; the
  harness then waits (bounded) for every child process to end and kills and records any
  that did not, so one contender's leftovers never slow the next.
* **Bounded.** A measurement streams at most ``items`` items and stops after
  ``budget_s`` seconds of timed streaming, so slow contenders still finish; a hang is cut
  off by a per-measurement deadline and recorded as a failure, as is any error.
* **Steady state.** Throughput is timed after a warm-up (a tenth of the items or a fifth
  of the budget, whichever comes first); start-up and shutdown are measured on their own.
"""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent

MPRS_PLUS = "mprs_plus"
TORCHDATA = "torchdata"
TORCH = "torch"
IN_PROCESS = "in-process"
# SPDL's iterate_in_subprocess with its zero-copy SharedMemorySegmentPool: optional (the
# "bench" extra installs it); without it the suite records n/a, saying why (spdl_missing).
SPDL = "spdl"
CONTENDERS = (MPRS_PLUS, TORCHDATA, TORCH, IN_PROCESS, SPDL)
# Said beside every SPDL figure: its design is one producer process, so --workers does
# not apply to it, and a comparison at N workers is N processes against one.
SPDL_NOTE = "ONE subprocess by design (SPDL's iterate_in_subprocess), whatever --workers says"
MEMCPY = "memcpy"  # not a contender: the single-core copy bandwidth bandwidths are compared with

OK, FAILED, NOT_APPLICABLE = "ok", "failed", "n/a"

GB = 1e9
MiB = 1 << 20


# -- what a workload declares ----------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """One run's configuration; every runner receives it."""

    quick: bool = False
    num_workers: int = 2
    context: str = "fork"
    repetitions: int = 5
    budget_s: float = 3.0  # timed streaming per throughput measurement, after warm-up
    deadline_s: float = 120.0  # a measurement still running after this is cut off
    shutdown_limit_s: float = 20.0  # a loader's shutdown still running after this is cut off
    reap_grace_s: float = 3.0  # after a measurement, how long child processes get to end
    cpu_loops: int = 0  # loop count of ``burn`` for about 2 ms; calibrated by run.py
    memory_gb: float = 10.0
    memory_bound_mib: float = 64.0


@dataclass(frozen=True)
class Metric:
    key: str
    unit: str  # "items/s", "GB/s", "s" or "MiB"
    higher_is_better: bool = True


@dataclass(frozen=True)
class Target:
    """What the project wants: ``metric`` of mprs_plus at least ``threshold`` times ``against``
    (a contender or MEMCPY), the ratio oriented so that above 1 is better for mprs_plus; or,
    with ``against=None``, the value itself within ``threshold`` (in the metric's direction)."""

    metric: str
    against: str | None
    threshold: float
    threshold_setting: str | None = None  # take the threshold from this field of Settings instead

    def resolve(self, settings: Settings) -> float:
        return float(getattr(settings, self.threshold_setting)) if self.threshold_setting else self.threshold


# Bytes delivered per second of main-process CPU time (see ``stream``). Against memcpy:
# 20x memcpy means the main process spends at most 5% of one copy's time on an item.
MAIN_CPU = Metric("main_cpu_gbps", "GB/s")

Runner = Callable[[Settings], Mapping[str, Any]]


@dataclass(frozen=True)
class Workload:
    """A workload: its metrics, one runner per contender it applies to, and its targets.

    A runner returns a value for each metric; any other keys are kept as details in the JSON.
    A contender without a runner is recorded as not applicable, with its note saying why.
    """

    name: str
    title: str
    description: str
    metrics: tuple[Metric, ...]
    runners: Mapping[str, Runner]
    targets: tuple[Target, ...] = ()
    notes: Mapping[str, str] = field(default_factory=dict)
    in_quick: bool = True
    max_repetitions: int | None = None
    deadline_s: Callable[[Settings], float] | None = None

    def metric(self, key: str) -> Metric:
        return next(m for m in self.metrics if m.key == key)


@dataclass(frozen=True)
class SegmentPool:
    """The size of SPDL's ``SharedMemorySegmentPool`` for a workload: ``count`` segments of
    ``segment_bytes`` each. A segment holds one whole item, so it is at least an item's size."""

    segment_bytes: int
    count: int


# -- contenders ------------------------------------------------------------------------------


class Loader:
    """Something to iterate once, and ``close()`` to end every process it started."""

    def __init__(self, iterable: Iterable[Any], close: Callable[[], None] = lambda: None) -> None:
        self._iterable = iterable
        self._close = close
        self._closed = False

    def __iter__(self) -> Iterator[Any]:
        return iter(self._iterable)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._close()


class _TorchLoader(Loader):
    def __init__(self, loader: Any) -> None:
        self._iterator: Any = None
        super().__init__(loader, self._shutdown)

    def __iter__(self) -> Iterator[Any]:
        self._iterator = iter(self._iterable)
        return self._iterator

    def _shutdown(self) -> None:
        # What the iterator's own __del__ does, done now so that the time is measurable.
        shutdown = getattr(self._iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self._iterator = None


def spdl_missing() -> str | None:
    """Why the SPDL contender cannot run here, or None when it can."""
    try:
        from spdl.pipeline import SharedMemorySegmentPool, iterate_in_subprocess  # noqa: F401
    except ImportError as exc:
        return f"spdl is not installed ({exc}); 'pip install -e .[bench]' brings it"
    return None


def open_loader(
    contender: str, settings: Settings, *, pipe: Any = None, dataset: Any = None, pool: SegmentPool | None = None
) -> Loader:
    """The contender's loader over ``pipe`` (a DataPipe) or, for torch's DataLoader and
    SPDL, ``dataset`` (with ``pool``, SPDL's shared-memory arena; without, its queue only).

    Every contender runs with its defaults apart from the worker count and start method
    (and, for SPDL, which has no worker count, its pool and a torch thread count: see _spdl).
    """
    if contender == IN_PROCESS:
        return Loader(pipe)
    if contender == SPDL:
        from . import _spdl  # imports spdl: only for this contender, which is optional

        return _spdl.SpdlLoader(dataset, settings, pool)
    if contender == TORCH:
        import torch.utils.data

        return _TorchLoader(
            torch.utils.data.DataLoader(
                dataset,
                batch_size=None,
                num_workers=settings.num_workers,
                multiprocessing_context=settings.context,
            )
        )
    from torchdata.dataloader2 import DataLoader2

    if contender == MPRS_PLUS:
        from mprs_plus import MultiProcessingReadingService
    elif contender == TORCHDATA:
        from torchdata.dataloader2 import MultiProcessingReadingService
    else:
        raise ValueError(f"unknown contender {contender!r}; choose from {CONTENDERS}")
    service = MultiProcessingReadingService(settings.num_workers, multiprocessing_context=settings.context)
    loader = DataLoader2(pipe, reading_service=service)
    return Loader(loader, loader.shutdown)


# -- timing ----------------------------------------------------------------------------------


def stream(open_: Callable[[], Loader], *, items: int, settings: Settings, item_bytes: int = 0) -> dict[str, Any]:
    """Stream one loader and time it in steady state.

    Returns ``throughput`` in items/s, or in GB/s when ``item_bytes`` is given. The loader
    yields ``items`` items unless the time budget stops it early; an epoch that ends with
    another count is an error (a contender that duplicates or drops items is not faster).
    Stopping early shuts the loader down mid-epoch, as a ``break`` out of a training loop does.

    Also returns the main process's CPU time per item over the same timed window
    (``main_cpu_per_item``, seconds of CPU, every thread of the main process), and with
    ``item_bytes`` the bytes delivered per second of that CPU time (``main_cpu_gbps``).
    Unlike throughput, these do not depend on how many cores the machine has: they show
    what every item costs the one process that trains, whatever the workers do. And the
    same for each child process alive at the first item (``children_cpu_per_item``, one
    figure per child, in the order of their process ids, from the first item to the last
    look that found it alive, read every ``CHILDREN_LOOK_S``; from the first item rather
    than the window's start because workers run ahead of the loop: the items of the window
    may all be made before it begins, more so in a short epoch): beside the main process's,
    they show which process limits, and what a worker pays per item against the main
    process doing the same work itself (a contender without workers).
    """
    warm_items = max(1, items // 10)
    warm_s = settings.budget_s / 5
    clock, cpu_clock = time.perf_counter, time.process_time
    count = timed_from = 0
    first = start = end = cpu_start = cpu_end = 0.0
    children: dict[int, float] = {}  # CPU seconds of each child at the first item
    children_end: dict[int, float] = {}  # ... at the last look that found it alive
    children_items: dict[int, int] = {}  # ... and the items the loop had timed by then
    looked = 0.0
    stopped_early = False
    loader = open_()
    item: Any = None
    try:
        for item in loader:
            count += 1
            if not timed_from:
                now = clock()
                if count == 1:
                    first = now
                    children = _children_cpu()
                if count >= warm_items or now - first >= warm_s:
                    start, timed_from, cpu_start = clock(), count, cpu_clock()
                    seen = _children_cpu()  # a first look: a worker may end before the next
                    children_end.update(seen)
                    children_items.update(dict.fromkeys(seen, count - 1))
                    looked = start
            elif count & 15 == 0:
                now = clock()
                if now - start >= settings.budget_s:
                    stopped_early = True
                    break
                if now - looked >= CHILDREN_LOOK_S:  # workers may end before the loop does
                    seen, looked = _children_cpu(), now
                    children_end.update(seen)
                    children_items.update(dict.fromkeys(seen, count - 1))
        end, cpu_end = clock(), cpu_clock()
        if timed_from:
            seen = _children_cpu()
            children_end.update(seen)
            children_items.update(dict.fromkeys(seen, count - 1))
        # A consumer drops its item before it stops: one still held would pin the memory it
        # views (SPDL's pool keeps such a segment past its own shutdown).
        item = None
    except BaseException:
        item = None
        close_within(loader, settings)
        raise
    problem = close_within(loader, settings)
    if not stopped_early and count != items:
        raise RuntimeError(f"the epoch yielded {count} items, expected {items}")
    if not timed_from or count == timed_from:
        raise RuntimeError(f"too few items ({count}) to time after the warm-up")
    timed = count - timed_from
    rate = timed / (end - start)
    cpu_per_item = (cpu_end - cpu_start) / timed
    result: dict[str, Any] = {
        "throughput": rate * item_bytes / GB if item_bytes else rate,
        "items_timed": timed,
        "stopped_early": stopped_early,
        "main_cpu_per_item": cpu_per_item,
        "children_cpu_per_item": [
            (children_end[pid] - children[pid]) / children_items[pid]
            for pid in sorted(children)
            if children_items.get(pid)
        ],
    }
    if item_bytes:
        # process_time ticks in clock ticks at worst; a window with no measurable CPU is
        # reported as the largest figure that window can show rather than a division by zero.
        result["main_cpu_gbps"] = item_bytes * timed / max(cpu_end - cpu_start, 1e-6) / GB
    if problem:
        result["problems"] = [f"after {'an early stop' if stopped_early else 'the epoch'}: {problem}"]
    return result


# How often ``stream`` reads its children's CPU times: a worker that ends before the loop
# (its share done, the rest in the channel) is measured up to its last look.
CHILDREN_LOOK_S = 0.05


def _children_cpu() -> dict[int, float]:
    """CPU seconds (user and system, every thread) of each live child process, by id."""
    found = {}
    for child in child_processes():
        seconds = _run_time(child.pid)
        if seconds is None:
            try:
                times = child.cpu_times()
            except psutil.Error:
                continue
            seconds = times.user + times.system
        found[child.pid] = seconds
    return found


def _run_time(pid: int) -> float | None:
    """Seconds on a CPU of the live threads of ``pid``, to the nanosecond (Linux's
    ``schedstat``); None where it cannot be read. psutil's figure comes in clock ticks
    (10 ms): a worker of a short epoch spends less than one in a window, and read 0."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:
            continue  # a thread that ended just now
        except (OSError, ValueError, IndexError):
            return None
    return total / 1e9


class MeasurementTimeout(Exception):
    pass


class NotApplicable(Exception):
    """Raised by a runner whose contender cannot take the workload (a loader that refuses its
    arguments): the cell is n/a with this reason as its note, not a failure."""


@contextlib.contextmanager
def deadline(seconds: float, what: str = "the measurement") -> Iterator[None]:
    """Raise ``MeasurementTimeout`` in the main thread if the block runs past ``seconds``.

    Blocking waits in the main thread (pipes, locks, process joins) are interrupted by the
    signal, so a hung contender becomes a recorded failure instead of a hung suite.
    Deadlines nest: an inner one never outlasts the outer one, which resumes afterwards.
    """
    outer_left, _ = signal.getitimer(signal.ITIMER_REAL)
    outer_handler = signal.getsignal(signal.SIGALRM)
    limit = min(seconds, outer_left) if outer_left > 0 else seconds

    def expire(signum: int, frame: Any) -> None:
        raise MeasurementTimeout(f"{what} took longer than {limit:g} s")

    started = time.monotonic()
    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, outer_handler)
        if outer_left > 0:
            # Re-arm the outer deadline; if it is already due it fires at once.
            signal.setitimer(signal.ITIMER_REAL, max(outer_left - (time.monotonic() - started), 1e-3))


def close_within(loader: Loader, settings: Settings) -> str | None:
    """Close ``loader`` within the settings' shutdown limit; the problem as text, or None.

    A contender whose shutdown hangs still produced valid figures before it; the hang is
    reported beside them, and the harness ends its processes afterwards.
    """
    try:
        with deadline(settings.shutdown_limit_s, "shutdown"):
            loader.close()
    except Exception as exc:
        return describe(exc)
    return None


def memcpy_bandwidth(nbytes: int, repeats: int) -> float:
    """Single-core copy bandwidth in GB/s: the best of ``repeats`` copies of ``nbytes``
    between two buffers touched beforehand (so page faults are not timed)."""
    src = np.empty(nbytes, dtype=np.uint8)
    dst = np.empty(nbytes, dtype=np.uint8)
    src.fill(1)
    dst.fill(0)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / GB


# -- processes -------------------------------------------------------------------------------


def _is_session_helper(process: psutil.Process) -> bool:
    # multiprocessing's resource tracker and forkserver serve the whole interpreter by design.
    cmdline = " ".join(process.cmdline())
    return "resource_tracker" in cmdline or "forkserver" in cmdline


def child_processes() -> list[psutil.Process]:
    """Live child processes of this interpreter (recursively), session helpers excepted."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and not _is_session_helper(child):
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def end_children(grace_s: float = 10.0) -> list[int]:
    """Wait up to ``grace_s`` for every child process to end; kill those that do not.

    Returns the ids of the processes that had to be killed: a loader that leaves these
    behind after its shutdown leaks them.
    """
    deadline_at = time.monotonic() + grace_s
    alive = child_processes()
    while alive and time.monotonic() < deadline_at:
        time.sleep(0.05)  # not a synchronisation: a bounded look at processes we do not own
        alive = [p for p in alive if _running(p)]
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=5)
    return [p.pid for p in alive]


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# -- interleaving ----------------------------------------------------------------------------


@dataclass
class Cell:
    """Everything measured for one workload and one contender."""

    status: str = NOT_APPLICABLE
    note: str = ""
    samples: dict[str, list[float]] = field(default_factory=dict)
    details: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    killed_pids: list[int] = field(default_factory=list)

    def median(self, metric: str) -> float | None:
        values = self.samples.get(metric)
        return float(np.median(values)) if values else None


@dataclass
class Results:
    settings: Settings
    environment: dict[str, Any]
    workloads: list[Workload]
    cells: dict[str, dict[str, Cell]]
    memcpy_gbps: list[float]
    wall_s: float = 0.0
    load_averages: list[float] = field(default_factory=list)  # 1-minute load, after every step

    def memcpy_median(self) -> float | None:
        return float(np.median(self.memcpy_gbps)) if self.memcpy_gbps else None


def schedule(workloads: list[Workload], contenders: tuple[str, ...], repetitions: int) -> list[tuple[int, Workload | None, str]]:
    """(repetition, workload, contender) in run order; workload None is the memcpy probe.

    Every repetition visits every workload once, and within it every applicable contender
    once, starting with a different contender each repetition.
    """
    steps: list[tuple[int, Workload | None, str]] = []
    for rep in range(repetitions):
        steps.append((rep, None, MEMCPY))
        shift = rep % len(contenders)
        order = contenders[shift:] + contenders[:shift]
        for workload in workloads:
            if workload.max_repetitions is not None and rep >= workload.max_repetitions:
                continue
            steps += [(rep, workload, c) for c in order if c in workload.runners]
    return steps


def run_suite(
    workloads: list[Workload],
    settings: Settings,
    contenders: tuple[str, ...] = CONTENDERS,
    progress: bool = True,
) -> Results:
    spdl_absent = spdl_missing() if SPDL in contenders else None

    def note(workload: Workload, contender: str) -> str:
        runs_here = contender in workload.runners
        if runs_here and contender not in contenders:
            return "not selected in this run"
        if runs_here and contender == SPDL and spdl_absent:
            return spdl_absent
        notes = [workload.notes.get(contender, "")]
        if contender == SPDL and runs_here:
            notes.insert(0, SPDL_NOTE)
        elif contender == SPDL and not notes[0]:
            notes = ["not part of this workload"]
        return "; ".join(n for n in notes if n)

    cells = {w.name: {c: Cell(status=NOT_APPLICABLE, note=note(w, c)) for c in CONTENDERS} for w in workloads}
    if spdl_absent:  # an optional contender: recorded as n/a, with the reason, not a failure
        contenders = tuple(c for c in contenders if c != SPDL)
    results = Results(settings, environment(settings), workloads, cells, [])
    steps = schedule(workloads, contenders, settings.repetitions) if contenders else []
    started = time.perf_counter()
    bar = _progress(steps, progress)
    for rep, workload, contender in bar:
        label = "memcpy" if workload is None else f"{workload.name} / {contender}"
        bar.set_postfix_str(f"rep {rep + 1}/{settings.repetitions} {label}", refresh=True)
        if workload is None:
            results.memcpy_gbps.append(memcpy_bandwidth(64 * MiB if settings.quick else 256 * MiB, 5))
        else:
            _measure(workload, contender, settings, cells[workload.name][contender])
        # Other work on the machine shows here; a reader of the results should see it.
        results.load_averages.append(os.getloadavg()[0])
    bar.close()
    results.wall_s = time.perf_counter() - started
    results.environment["load_average_end"] = list(os.getloadavg())
    return results


def _progress(steps: list[Any], enabled: bool) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a comfort, not a requirement ("pip install tqdm" brings it)
        enabled = False
    if not enabled:
        return _Quiet(steps)
    return tqdm(steps, desc="benchmarks", unit="run", file=sys.stderr, dynamic_ncols=True)


class _Quiet(list):
    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def _measure(workload: Workload, contender: str, settings: Settings, cell: Cell) -> None:
    limit = workload.deadline_s(settings) if workload.deadline_s is not None else settings.deadline_s
    lent_before = _lent_so_far() if contender == MPRS_PLUS else None
    try:
        with deadline(limit):
            values = dict(workload.runners[contender](settings))
    except NotApplicable as exc:
        cell.status, cell.note = NOT_APPLICABLE, str(exc)
    except Exception as exc:
        cell.errors.append(describe(exc))
        if cell.status != OK:
            cell.status = FAILED
    else:
        cell.status = OK
        for metric in workload.metrics:
            cell.samples.setdefault(metric.key, []).append(float(values.pop(metric.key)))
        cell.errors += [f"(figures kept) {problem}" for problem in values.pop("problems", [])]
        cell.details.append(values)
    finally:
        gc.collect()  # loaders that escaped shutdown end here, before anyone else runs
        cell.killed_pids += end_children(grace_s=settings.reap_grace_s)
        if lent_before is not None:
            _note_lending(cell, lent_before)


def _lent_so_far() -> tuple[int, int]:
    """Large buffers this process's mprs_plus channels lent as views, and copied, so far."""
    from mprs_plus.transport import lending

    so_far = lending()
    return so_far.lent, so_far.copied


def _note_lending(cell: Cell, before: tuple[int, int]) -> None:
    """Say in the cell's note how its large items arrived, and through which transport
    (``MPRS_PLUS_TRANSPORT``): views of shared memory (lent), or copies."""
    from mprs_plus.transport import TRANSPORT

    lent, copied = (now - then for now, then in zip(_lent_so_far(), before))
    if cell.status != OK or not cell.details:
        return  # a failed run's figures are not kept; nor is what it lent
    cell.details[-1].update(lent=lent, copied=copied)
    lent = sum(d.get("lent", 0) for d in cell.details)
    copied = sum(d.get("copied", 0) for d in cell.details)
    if lent or copied:
        base = cell.note.split(" [transport ")[0]
        cell.note = f"{base} [transport {TRANSPORT}: large buffers lent {lent}, copied {copied}]".strip()


def describe(exc: BaseException) -> str:
    """The error in a few lines, with where it happened (for a timeout: where it was blocked)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.name != "expire"]
    origin = ""
    if frames:
        frame = frames[-1]
        path = Path(frame.filename)
        origin = f" (in {path.parent.name}/{path.name}:{frame.lineno} {frame.name})"
    text = f"{type(exc).__name__}: {exc}".strip()
    first_lines = "\n".join(text.splitlines()[:6])
    return (first_lines[:800] + origin).strip()


# -- environment -----------------------------------------------------------------------------


def environment(settings: Settings) -> dict[str, Any]:
    """What a reader needs to compare two result files."""
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "versions": {name: _version(name) for name in ("mprs_plus", "torch", "torchdata", "numpy", "psutil", "spdl")},
        "cpu_model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
        "start_method": settings.context,
        "transport": _transport(),
        "num_workers": settings.num_workers,
        "git": _git(),
        "load_average_start": list(os.getloadavg()),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }


def _transport() -> str:
    """mprs_plus's transport (``MPRS_PLUS_TRANSPORT``) and the shared memory it lends from."""
    from mprs_plus.transport import TRANSPORT
    from mprs_plus.transport._memory import memory_kinds

    return f"{TRANSPORT} (shared memory: {memory_kinds()[0]})"


def _version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        module = sys.modules.get(name)
        return getattr(module, "__version__", None)


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _git() -> dict[str, Any] | None:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return None


def settings_dict(settings: Settings) -> dict[str, Any]:
    return asdict(settings)
