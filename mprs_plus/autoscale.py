"""``num_workers="auto"``: how many workers, decided from what the engine measures. Pure: no
processes, no I/O, no clock (the mechanism, ``dataloader/auto.py``, measures and resizes).

    the mechanism measures a Window           the policy answers a Decision
    (since the workers last changed):         (the count, and why, in words)
      the loop's wait for batches       -->     grow    the loop waits for busy workers:
      the workers' busy time and CPU                    as many more as its wait asks for,
      the largest worker's private memory                at most 8x at once; past the cores
      the memory still available                         only while the samples wait (little
                                                        CPU per busy second)
                                                stay    the loop sets the pace, or what
                                                        slows it is not the workers (they
                                                        are idle: the transport, the main
                                                        process), or a limit is reached
                                                shrink  the loop sets the pace and the
                                                        workers idle more than half the time;
                                                        growth then stays below that count

The limits, each named when it holds the count down:

    max_workers   the user's cap (default ``default_max_workers``: 4x the cores, at least 4)
    cores         workers that use the CPU while busy never outnumber the cores the process
                  may use (``cores``: affinity and the cgroup's quota), the loop's own share
                  left to it; a worker busy 10% on the CPU counts as a tenth of a core
    memory        a new worker must fit in the memory still available (the machine's or the
                  cgroup's, the smaller) with ``HEADROOM`` times the largest worker's private
                  memory measured so far, and ``RESERVE`` of it left to everything else

A window decides nothing until it holds ``MIN_BATCHES`` batches and ``MIN_SECONDS``
seconds (``QUICK_BATCHES`` where the loop waited ``QUICK_WAITS`` of it or more): a resize
costs a start of the workers, so the policy grows geometrically and never on the noise of
a few batches. For the same reason growth waits for the next epoch where the rest of this
one is too short to win a start back (``start_pays``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

WAITS = 0.1  # the loop waits this share of its time for batches or more: the workers are short
IDLE = 0.5  # workers busy less than this share of their time are not what the loop waits for
CPU_BOUND = 0.5  # CPU seconds per busy second at or above which a worker needs a core
SHRINK_BUSY = 0.4  # the loop sets the pace and the workers are busy less than this: fewer do
NEAR_CAP = 1.25  # a count this near max_workers goes to it at once
GROWTH = 8  # at most this many times the workers at once (each change is a start of the workers)
HEADROOM = 1.5  # a new worker is expected to reach this many times the largest one's private memory
RESERVE = 0.1  # of the memory still available, kept for everything else
MIN_BATCHES = 6
MIN_SECONDS = 0.2
# A loop that does nothing but wait is judged sooner: its answer is plain after a few
# batches, and every batch of that window is made at the slowest count the run will see
# (samples that wait 10 ms, batches of 8: the 6th batch at one worker came at 0.5 s).
QUICK_BATCHES = 3
QUICK_WAITS = 0.8


def default_max_workers(cores: int) -> int:
    """A small multiple of the cores: workers whose samples wait (storage, the network) can
    use more than the cores, never without bound."""
    return max(4, 4 * cores)


def usable_cores() -> int:
    """The cores this process may run on: its affinity, and the cgroup's CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def _cgroup_cpu_quota() -> float | None:
    """Cores' worth of CPU time the cgroup allows per period (v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us``); None without a limit. Read once, when a policy is made."""
    for path, parse in (("/sys/fs/cgroup/cpu.max", _v2_quota), ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", None)):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if parse is not None:
            return parse(text)
        try:
            quota = int(text)
            with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
                period = int(f.read().strip())
        except (OSError, ValueError):
            return None
        return quota / period if quota > 0 and period > 0 else None
    return None


def _v2_quota(text: str) -> float | None:
    quota, _, period = text.partition(" ")
    if quota == "max" or not quota.isdigit() or not period.isdigit() or int(period) == 0:
        return None
    return int(quota) / int(period)


@dataclass(frozen=True)
class Window:
    """What the engine measured since the workers last changed (or the epoch began)."""

    workers: int
    seconds: float  # wall time of the window
    batches: int  # batches the loop received in it
    loop_wait_s: float  # of it, the loop waited inside next() for a batch
    busy_s: float  # the workers' busy time, added up (making batches: CPU or waiting on storage)
    cpu_s: float  # the workers' CPU time, added up
    main_cpu_s: float = 0.0  # the training process's CPU time (the loop, receiving)
    worker_memory: int = 0  # bytes of private memory of the largest worker, 0 where unknown
    available_memory: int | None = None  # bytes the machine or cgroup can still give; None: unknown

    @property
    def wait_fraction(self) -> float:
        return self.loop_wait_s / self.seconds if self.seconds > 0 else 0.0

    @property
    def busy_fraction(self) -> float:
        """Per worker, the share of the window it spent making batches (at most 1: counts
        published a moment before the window began can make it read more)."""
        if not self.workers or self.seconds <= 0:
            return 0.0
        return min(1.0, self.busy_s / (self.workers * self.seconds))

    @property
    def cpu_fraction(self) -> float:
        """Per worker, the share of the window it ran on a CPU (at most 1)."""
        if not self.workers or self.seconds <= 0:
            return 0.0
        return min(1.0, self.cpu_s / (self.workers * self.seconds))

    @property
    def cpu_per_busy(self) -> float:
        """CPU seconds per busy second: ~1 for work on the CPU, ~0 for samples that wait."""
        busy = self.busy_fraction
        return min(1.0, self.cpu_fraction / busy) if busy > 0 else 1.0


@dataclass(frozen=True)
class Decision:
    workers: int
    reason: str  # why, in words (stats() and the summary say it)
    limit: str = ""  # the limit that held it: "max_workers", "cores", "memory" ("" none)


@dataclass
class AutoPolicy:
    """Decides the worker count window by window (see the module docstring)."""

    max_workers: int
    cores: int
    start: int = 1
    decisions: list[Decision] = field(default_factory=list)
    retired_from: int | None = None  # the last count retired for idling behind the loop

    def __post_init__(self) -> None:
        if self.max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {self.max_workers}")
        self.start = max(1, min(self.start, self.max_workers))

    def first(self, worker_memory: int = 0, available_memory: int | None = None) -> Decision:
        """The count to start with: small (``start``), within the memory gate."""
        fits = self._memory_allows(0, worker_memory, available_memory)
        count = max(1, min(self.start, fits))
        decision = Decision(count, f"started with {count} (num_workers='auto' starts small)")
        self.decisions.append(decision)
        return decision

    def ready(self, window: Window) -> bool:
        """Whether ``window`` holds enough to decide on."""
        if window.seconds < MIN_SECONDS:
            return False
        return window.batches >= MIN_BATCHES or (window.batches >= QUICK_BATCHES and window.wait_fraction >= QUICK_WAITS)

    def decide(self, window: Window) -> Decision:
        """The count for what comes next, and why; ``window.workers`` when nothing changes."""
        n = window.workers
        waits, busy = window.wait_fraction, window.busy_fraction
        if waits < WAITS:
            if busy < SHRINK_BUSY and n > 1:
                target = max(1, math.ceil(n * busy / (1 - WAITS / 2)))  # enough to stay busy ~95%
                if target <= n // 2:
                    self.retired_from = n  # enough, and wasteful: growth stays below it from now on
                    return self._record(
                        Decision(target, f"{n} -> {target}: the loop sets the pace (it waits {waits:.0%} of the time) "
                                         f"and the workers are busy only {busy:.0%} of theirs")
                    )
            return self._record(
                Decision(n, f"stays at {n}: the loop sets the pace (it waits {waits:.0%} of the time for batches)")
            )
        if busy < IDLE:
            return self._record(
                Decision(n, f"stays at {n}: the loop waits {waits:.0%} of the time, but the workers are busy only "
                            f"{busy:.0%} of theirs, so more would not help (the transport or the main process is slower)")
            )
        # The loop waits for busy workers: as many more as removing its wait asks for.
        wanted = math.ceil(n / max(1 - waits, 1 / GROWTH) * 1.1)
        target, limit = min(wanted, n * GROWTH), ""
        if target * NEAR_CAP >= self.max_workers:  # a change costs a start: not one more for the last few
            target, limit = self.max_workers, "max_workers"
        if self.retired_from is not None and target >= self.retired_from:
            # That many kept up with workers mostly idle: between there and here, never back (no
            # change back and forth, each a start of the workers).
            target, limit = self.retired_from - 1, "retired"
        cpu = window.cpu_per_busy
        if cpu >= CPU_BOUND:
            main_share = min(0.9, window.main_cpu_s / window.seconds) if window.seconds > 0 else 0.0
            by_cores = max(1, round((self.cores - main_share) / cpu))
            if target > by_cores:
                target, limit = max(n, by_cores), "cores"
        fits = self._memory_allows(n, window.worker_memory, window.available_memory)
        if target > fits:
            target, limit = max(n, fits), "memory"
        why = (
            f"the loop waits {waits:.0%} of the time for workers busy {busy:.0%} of theirs "
            + ("(their samples wait: little CPU per busy second)" if cpu < CPU_BOUND else "(on the CPU)")
        )
        held = {
            "max_workers": f"; held at max_workers={self.max_workers}",
            "cores": f"; held at the {self.cores} cores (workers on the CPU)",
            "memory": "; held by memory: another worker would not fit in what is available",
            "retired": f"; held below {self.retired_from}, which kept up with its workers mostly idle",
            "": "",
        }[limit]
        if target <= n:
            return self._record(Decision(n, f"stays at {n}: {why}{held}", limit))
        return self._record(Decision(target, f"{n} -> {target}: {why}{held}", limit))

    def _memory_allows(self, n: int, worker_memory: int, available: int | None) -> int:
        """How many workers the memory gate allows, ``n`` of them running already."""
        if available is None or worker_memory <= 0:
            return self.max_workers  # unknown: the cap alone (measured once a worker ran)
        spare = max(0, available * (1 - RESERVE))
        return n + int(spare // (worker_memory * HEADROOM))

    def _record(self, decision: Decision) -> Decision:
        self.decisions.append(decision)
        return decision

    def defer(self, decision: Decision, batches_left: int) -> None:
        """``decision`` (the last one made) takes effect at the next epoch's start: the
        rest of this epoch is too short to win a start of the workers back."""
        if self.decisions and self.decisions[-1] is decision:
            self.decisions[-1] = Decision(
                decision.workers,
                f"{decision.reason}; from the next epoch on: the {batches_left} batches left of this one "
                "would not win a start of the workers back",
                decision.limit,
            )

    @property
    def history(self) -> list[int]:
        """The counts chosen, in order, each once (1 -> 4 -> 8)."""
        counts: list[int] = []
        for decision in self.decisions:
            if not counts or counts[-1] != decision.workers:
                counts.append(decision.workers)
        return counts

    def summary(self) -> str:
        """One line for stats(): the count now, how it got there, and the last reason."""
        if not self.decisions:
            return ""
        path = " -> ".join(str(c) for c in self.history)
        last = self.decisions[-1]
        return f"num_workers='auto': {last.workers} worker{'s' if last.workers != 1 else ''} ({path}); {last.reason}"


def start_pays(window: Window, target: int, batches_left: int, start_s: float) -> bool:
    """Whether starting ``target`` workers now ends the epoch's last ``batches_left``
    batches sooner than the ``window.workers`` running would, the start (``start_s``
    seconds, as the last one took) included. At best the new count takes the loop's whole
    wait away, or speeds the batches up as the count grows, whichever is less: an estimate
    on the generous side, so a start that pays is never refused."""
    if window.batches <= 0 or window.seconds <= 0 or target <= window.workers:
        return True
    rate = window.batches / window.seconds
    speedup = min(target / window.workers, 1 / max(1 - window.wait_fraction, 1 / GROWTH))
    return start_s + batches_left / (rate * speedup) < batches_left / rate
