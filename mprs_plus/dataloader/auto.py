"""``num_workers="auto"`` for ``mprs_plus.DataLoader``: the measurements the policy
(``mprs_plus/autoscale.py``) decides on, taken from a running epoch.

    LoaderIterator.__next__ --waited(seconds)--> AutoWorkers   the loop's wait for each batch
                            <--due()---------                  a window long enough to judge
                            --decide(run)---->                 the workers' busy time (the
                                                               statistics table), their CPU and
                                                               private memory (psutil), the
                                                               memory still available
                            <--a new count, or None            (the policy's Decision)

The iterator then resizes (``iterator.LoaderIterator._resize``): what the loop has not
received of the epoch is dealt anew over the new count, exactly as a checkpoint restores
at another count (``elastic.py``): the workers stop, the new ones start on the rest.

A window begins with the first batch a run hands out, never before: a run's start (its
workers forking, their first batch) is not what the policy should judge its count by.
One ``AutoWorkers`` lives as long as its loader (``LoaderKeep``): an epoch begins with the
count the last one chose.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from .. import autoscale
from ..autoscale import AutoPolicy, Decision, Window, default_max_workers, usable_cores

AUTO = "auto"
MAX_CHANGES = 3  # changes of count within one epoch, at most (each costs a start of the workers)
# Workers an "auto" loader starts with, at most the cores. Two rather than one: each change
# of count is a start of the workers, and with one the first window of every workload that
# needs more is made at half speed. Measured on 2 cores (``benchmarks/auto_workers.py``),
# starting at 1 against 2: tiny samples 0.75x against 1.06x the best fixed count, 2 ms of
# CPU 0.93x against 0.98x, samples that wait 0.92x against 0.93x; a loop that sets the pace
# retires the second worker (1.11x the CPU of one worker, within its 1.25x).
FIRST_WORKERS = 2


class AutoCount(int):
    """What ``loader.num_workers`` reads with ``num_workers="auto"``: ``"auto"`` where it is
    printed or compared with ``"auto"``, and, as a number, its cap (``max_workers``). Code
    that compares the attribute with a count (a trainer's warning about too few workers,
    torch's own checks) keeps working, and a trainer that re-creates the loader from its
    attributes passes it back, which asks for "auto" again."""

    def __repr__(self) -> str:
        return repr(AUTO)

    def __str__(self) -> str:
        return AUTO

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            return other == AUTO
        return int(self) == other

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = int.__hash__

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return (AutoCount, (int(self),))


def check_max_workers(max_workers: Any) -> int | None:
    if max_workers is None:
        return None
    if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
        raise ValueError(f"max_workers must be an int >= 1 (or None: 4x the cores), got {max_workers!r}")
    return max_workers


class AutoWorkers:
    """A loader's automatic worker count: the policy, and the window being measured."""

    def __init__(self, max_workers: int | None = None, policy: AutoPolicy | None = None) -> None:
        if policy is None:
            cores = usable_cores()
            policy = AutoPolicy(max_workers or default_max_workers(cores), cores, start=min(FIRST_WORKERS, cores))
        self.policy = policy
        self.count = policy.first().workers
        self.resizes = 0  # counts changed within an epoch (each a start of the workers)
        self.changes_this_epoch = 0
        self.started: list[int] = []  # every worker process started, by pid (tests count them)
        self.start_s = 0.0  # seconds the last start of the workers took, to its first batch
        self._window: _Open | None = None
        self._begun = time.monotonic()
        self._deferred = False  # a count decided for the next epoch: this one judges no more

    def begin(self) -> None:
        """A run of the current count is about to start, then hand out its first batch: no
        window yet."""
        self._window = None
        self._begun = time.monotonic()

    def run_stopped(self) -> None:
        """The run measured stopped: its window goes (the next run opens its own), and with
        it the last reference this object held to the run."""
        self._window = None

    def epoch_began(self) -> None:
        self.changes_this_epoch = 0
        self._deferred = False

    def waited(self, seconds: float, run: Any) -> None:
        """The loop got a batch after waiting ``seconds`` for it."""
        window = self._window
        if window is None:  # the run's first batch: the window begins after it
            self.start_s = time.monotonic() - self._begun
            self._window = _Open(run, self)
            return
        window.batches += 1
        window.wait += seconds

    def due(self) -> bool:
        """Whether the window holds enough to judge (asked after every batch: cheap)."""
        window = self._window
        if window is None or window.batches < autoscale.QUICK_BATCHES or self._deferred:
            return False
        return self.policy.ready(window.peek())

    def decide(self, batches_left: Callable[[], int | None] = lambda: None) -> Decision | None:
        """Judge the window that is due; a Decision when the count changes now, else None
        (a new window begins either way). More workers than the rest of the epoch
        (``batches_left()``, None where unknown) would win a start back are the next
        epoch's count, not a start now (``autoscale.start_pays``)."""
        window, self._window = self._window, None
        if window is None:
            return None
        measured = window.close(self.count, self)
        decision = self.policy.decide(measured)
        self._window = _Open(window.run, self)
        if decision.workers == self.count or self.changes_this_epoch >= MAX_CHANGES:
            return None  # at most MAX_CHANGES starts of the workers an epoch, whatever the figures say
        if decision.workers > self.count:
            left = batches_left()
            if left is not None and not autoscale.start_pays(measured, decision.workers, left, self.start_s):
                self.count = decision.workers
                self.policy.defer(decision, left)
                self._deferred = True  # the workers running are not self.count: no window until the next epoch
                return None
        self.changes_this_epoch += 1
        self.count = decision.workers
        self.resizes += 1
        return decision

    def note_started(self, run: Any) -> None:
        for handle in run.runtime.worker_processes():
            if handle.pid is not None and handle.pid not in self.started:
                self.started.append(handle.pid)

    def summary(self) -> str:
        return self.policy.summary()

    # Where the figures come from: overridable (the tests force them).

    def measure_workers(self, run: Any) -> tuple[float, float, int]:
        """(busy seconds, CPU seconds, the largest private memory) of ``run``'s workers so
        far. CPU seconds count the time a worker waited for a core as well as the time it
        ran (``/proc/<pid>/schedstat``): on a machine whose cores are all taken, a worker
        starved of CPU must not read as one whose samples wait on storage."""
        busy, memory = 0.0, 0
        try:
            stats = run.runtime.stats()
        except Exception:
            stats = None
        if stats is not None:
            for process in stats.processes:
                if process.role == "worker":
                    busy += process.busy_s
                    memory = max(memory, process.private_bytes)
        cpu = 0.0
        for handle in run.runtime.worker_processes():
            cpu += _wants_cpu(handle.pid)
            if not memory:
                memory = _private_estimate(handle.pid)
        return busy, cpu, memory

    def available_memory(self) -> int | None:
        return available_memory()


class _Open:
    """A window being measured: its start's figures, the loop's waits since. It holds the
    run it measures, not its owner: the owner holds it, and a cycle would keep the run's
    channels mapped until a garbage collection."""

    def __init__(self, run: Any, owner: AutoWorkers) -> None:
        self.run = run
        self.started = time.monotonic()
        self.main_cpu = time.process_time()
        self.busy, self.cpu, _ = owner.measure_workers(run)
        self.batches = 0
        self.wait = 0.0

    def peek(self) -> Window:
        """Enough to say whether it is long enough (no figures read)."""
        return Window(1, time.monotonic() - self.started, self.batches, self.wait, 0.0, 0.0)

    def close(self, workers: int, owner: AutoWorkers) -> Window:
        busy, cpu, memory = owner.measure_workers(self.run)
        return Window(
            workers=workers,
            seconds=time.monotonic() - self.started,
            batches=self.batches,
            loop_wait_s=self.wait,
            busy_s=max(0.0, busy - self.busy),
            cpu_s=max(0.0, cpu - self.cpu),
            main_cpu_s=max(0.0, time.process_time() - self.main_cpu),
            worker_memory=memory,
            available_memory=owner.available_memory(),
        )


def _wants_cpu(pid: int | None) -> float:
    """Seconds ``pid`` ran on a CPU or waited in a run queue for one; its CPU time where
    the scheduler's statistics are not there; 0 where it is gone."""
    if pid is None:
        return 0.0
    try:  # every thread's: a worker's lanes and its listener are threads of their own
        total = 0
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                ran, queued = f.read().split()[:2]
            total += int(ran) + int(queued)
        return total / 1e9
    except (OSError, ValueError):
        pass
    try:
        import psutil

        times = psutil.Process(pid).cpu_times()
        return times.user + times.system
    except Exception:  # gone meanwhile (a replacement starts), or no psutil
        return 0.0


def _private_estimate(pid: int | None) -> int:
    """Resident memory not shared, cheaply (``statm``): before a worker sampled its own."""
    if pid is None:
        return 0
    try:
        import psutil

        info = psutil.Process(pid).memory_info()
        return max(0, info.rss - getattr(info, "shared", 0))
    except Exception:
        return 0


def available_memory() -> int | None:
    """Bytes this process's children may still take: the machine's available memory, or
    what the cgroup's limit leaves, the smaller; None where neither can be read."""
    found: list[int] = []
    try:
        import psutil

        found.append(int(psutil.virtual_memory().available))
    except Exception:
        pass
    left = _cgroup_left()
    if left is not None:
        found.append(left)
    return min(found) if found else None


def _cgroup_left() -> int | None:
    from ..runtime.main.oom import counters

    for counter in counters():
        folder = os.path.dirname(counter.path)
        for limit_name, used_name in (("memory.max", "memory.current"), ("memory.limit_in_bytes", "memory.usage_in_bytes")):
            try:
                with open(os.path.join(folder, limit_name)) as f:
                    limit = f.read().strip()
                with open(os.path.join(folder, used_name)) as f:
                    used = int(f.read().strip())
            except (OSError, ValueError):
                continue
            if limit.isdigit() and int(limit) < (1 << 60):  # v1 reads a huge number for "no limit"
                return max(0, int(limit) - used)
    return None
