"""A dead worker replaced, not the run ended: the budget, the poison rule, what is said.

    reader finds worker w dead --> Replacements.on_death(w, pid, exit code, items received,
                                                         the item it was making)
        budget spent ............. the death error, saying how many were replaced before
        making the item its        a poison item: its place gets a ``LostItem`` (the loop's
        predecessor died making .. error for that item) and the replacement leaves it out;
                                   only for a stream that can leave an item out (``skips_lost``)
        otherwise ................ a replacement, restored to the items the loop has

Which item a worker was making is in shared memory (``liveness.py``: each lane stores the
position of the item it begins), so the first death already names it, even when the dead
worker had made items after the last one the main process received and never sent them.
A replacement hands its first items on one at a time (``Reset.careful``): when it dies
making the same item, every item before it has reached the main process, and the
``LostItem`` takes exactly that item's place. A poison sample costs two deaths. A Ray
actor stores no such slot: the items received stand for it, and its poison sample costs
a third death when the first actor died holding items it never sent.
    --> a warning at the user's line, a ``Replacement`` in the statistics

A replacement is a restore of one worker (``restore.py`` does it for all of them): started
anew, it runs its reset for the epoch the dead one was in, loads the generator states that
the dead one recorded as that epoch began (``generators.py``), and produces and drops the
items the main process had already received from the dead one (``Reset.skip``). With
``in_order=True`` the loop then sees the uninterrupted run; with ``in_order=False`` the
same set.

Memory: a killed process cannot be asked for its memory, so while replacements are
allowed a thread samples each worker's resident memory, and the machine's and cgroup's
use, twice a second (``MemoryWatch``): the warning names the last sample, and says
"likely the out-of-memory killer" for a SIGKILL with memory near a limit then. A sample
can miss a spike; the kernel's own count of OOM kills cannot (``oom.py``): a SIGKILL
with the cgroup's count risen since the last death is "killed by the out-of-memory killer". A Ray
actor (``backends/ray``) is not sampled: its memory is another node's; its records reach
the main process on its data channel (``generators.SentRecord``).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any, NamedTuple

from ...errors import ProcessDiedError
from ...user_frame import warn
from .oom import OomKills

_SAMPLE_SECONDS = 0.5
_NEAR_LIMIT = 0.9  # memory in use, as a fraction of the limit, that reads as "near the limit"


class Replacement(NamedTuple):
    """One dead worker replaced: who, how it ended, where in its stream, its memory."""

    worker: int
    pid: int
    cause: str  # "SIGKILL", "exit code 3"
    epoch: int
    items: int  # items of the epoch the main process had received from it
    rss_bytes: int | None  # its last resident memory sampled, None if never sampled
    out_of_memory: bool  # killed by the OOM killer (its cgroup counted a kill), or with memory near a limit
    poison: bool  # it died at the same item as the worker before it: that item was left out
    oom_kill: bool = False  # the cgroup's count of OOM kills rose with this death (``oom.py``): known, not likely


class LostItem(NamedTuple):
    """In the place of an item that killed two workers in turn: the loop gets this error there."""

    worker: int
    position: int  # the item's position in the worker's stream of the epoch
    pid: int
    cause: str

    def error(self, names: str = "") -> RuntimeError:
        """torch's words for a worker killed by a signal (or gone), naming the item."""
        what = names or f"item {self.position} of worker {self.worker}"
        if self.cause.startswith("SIG"):
            try:
                said = signal.strsignal(signal.Signals[self.cause]) or self.cause
            except (KeyError, ValueError):
                said = self.cause
            head = f"DataLoader worker (pid {self.pid}) is killed by signal: {said}."
        else:
            head = f"DataLoader worker (pid(s) {self.pid}) exited unexpectedly ({self.cause})."
        return RuntimeError(
            f"{head} Two workers in turn died making {what}: it is left out, and the epoch goes on with the "
            "next one. Look for the sample that kills the process (a corrupt file, a native decoder's crash)."
        )


def cause_of(exitcode: int | None) -> str:
    if exitcode is None:
        return "unknown"
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


class MemoryWatch:
    """Each worker's last resident memory, and whether memory was near a limit, sampled by a
    daemon thread that ends with the service (it holds no part of the runtime)."""

    def __init__(self) -> None:
        self.rss: dict[int, int] = {}  # by pid
        self.near_limit = False

    def start(self, lifecycle: Any, pids: Callable[[], list[int]]) -> None:
        """Sample until ``lifecycle`` closes; ``pids()``: the workers now (replacements too)."""
        try:
            import psutil
        except ImportError:  # no samples: the warning says the memory is unknown
            return
        lifecycle.every(_SAMPLE_SECONDS, self, lambda live: live.sample(psutil, pids()), "mprs_plus memory watch")

    def sample(self, psutil: Any, pids: list[int]) -> None:
        for pid in pids:
            try:
                self.rss[pid] = psutil.Process(pid).memory_info().rss
            except Exception:  # gone meanwhile: its last sample stays
                pass
        memory = psutil.virtual_memory()
        used = 1.0 - memory.available / memory.total if memory.total else 0.0
        self.near_limit = used >= _NEAR_LIMIT or _cgroup_used() >= _NEAR_LIMIT


def _cgroup_used() -> float:
    """This process's cgroup (v2) memory in use as a fraction of its limit; 0.0 without one."""
    try:
        with open("/sys/fs/cgroup/memory.max") as limit_file, open("/sys/fs/cgroup/memory.current") as used_file:
            limit, used = limit_file.read().strip(), used_file.read().strip()
    except OSError:
        return 0.0
    if limit == "max" or not limit.isdigit() or not used.isdigit() or int(limit) == 0:
        return 0.0
    return int(used) / int(limit)


class Replacements:
    """The service's budget of replacements and their record (see the module docstring)."""

    def __init__(self, budget: int, skips_lost: bool, used_before: int = 0, oom: OomKills | None = None) -> None:
        self.budget = budget
        self.used_before = used_before  # by earlier runtimes of the same loader (one per epoch, not persistent)
        self.skips_lost = skips_lost  # the worker stream can leave an item out (``LoaderStage``)
        self.made: list[Replacement] = []
        self.memory = MemoryWatch()
        # The cgroup's OOM kills, counted from the service's start: the placement's, which its
        # death errors read too (one baseline for both); none for children of other nodes.
        self.oom = oom if oom is not None else OomKills(files=[])
        self._last_death: dict[int, tuple[int, tuple[int, ...]]] = {}  # worker -> (epoch, item it was making)

    def on_death(
        self,
        worker: int,
        pid: int,
        exitcode: int | None,
        epoch: int,
        received: tuple[int, ...],
        death_error: Any,
        making: tuple[int | None, ...] | None = None,
    ) -> Replacement:
        """Record the death of ``worker`` and say how it is replaced; raise the error the user
        gets when it is not (``death_error()``: the runtime's error for the death).

        ``making``: per lane, the position of the item the worker was making in ``epoch``
        (None where it had begun none: a death in its reset or ``worker_init_fn``); None
        where no such slots are kept (a Ray actor that began its stream), and then the
        items received stand for it (a careful replacement that dies with no more received
        than its predecessor died making the next one, at the cost of a third death when
        the first had made items it never sent). Poison: a worker that dies making the
        item its predecessor died making. It is left out only where every item before it
        was received (the ``LostItem`` takes its place); else (which a careful replacement
        prevents) the death is replaced like any other."""
        used = self.used_before + len(self.made)
        if used >= self.budget:
            raise _spent(death_error(), used, self.budget)
        cause = cause_of(exitcode)
        at: tuple[int | None, ...] | None = received if making is None else making
        if at is not None and None in at:
            at = None  # it died before its stream began: it names no item
        same = at is not None and self._last_death.get(worker) == (epoch, at)
        if same and not (self.skips_lost and len(received) == 1):
            raise _unskippable(death_error(), worker, at or received)
        poison = same and at == received
        rss = self.memory.rss.get(pid)
        oom_kill = cause == "SIGKILL" and self.oom.rose() is not None
        made = Replacement(
            worker,
            pid,
            cause,
            epoch,
            sum(received),
            rss,
            oom_kill or (cause == "SIGKILL" and self.memory.near_limit),
            poison,
            oom_kill,
        )
        self.made.append(made)
        if poison:
            self._last_death.pop(worker, None)
        elif at is not None:  # a death before its stream began says nothing of the item
            self._last_death[worker] = (epoch, at)
        _warn(made, self.used_before + len(self.made), self.budget)
        return made


def _warn(made: Replacement, count: int, budget: int) -> None:
    memory = f"{made.rss_bytes / (1 << 20):.0f} MiB" if made.rss_bytes is not None else "unknown"
    if made.oom_kill:
        likely = " from the out-of-memory killer (its cgroup's count of OOM kills rose)"
    else:
        likely = "; likely the out-of-memory killer" if made.out_of_memory else ""
    how = f"was killed by {made.cause}" if made.cause.startswith("SIG") else f"ended ({made.cause})"
    what = (
        f"item {made.items} of its epoch killed it and the worker before it: that item is left out"
        if made.poison
        else f"the main process had received {made.items} of its items of epoch {made.epoch}"
    )
    warn(
        f"mprs_plus: worker {made.worker} (pid {made.pid}) {how}{likely} (last resident memory {memory}); "
        f"{what}. A new worker replaces it and goes on from there (replacement {count} of "
        f"worker_restarts={budget}).",
        RuntimeWarning,
    )


_CANNOT = ". The reading service cannot continue"


def _spent(error: Exception, made: int, budget: int) -> Exception:
    text = str(error)
    note = f" ({made} dead worker(s) were replaced before, all that worker_restarts={budget} allows)"
    if _CANNOT in text:
        return ProcessDiedError(text.replace(_CANNOT, note + _CANNOT, 1))
    return ProcessDiedError(text + note)


def _unskippable(error: Exception, worker: int, at: tuple[Any, ...]) -> Exception:
    text = str(error)
    note = (
        f" (a replacement of worker {worker} died at the same item as the worker before it, item "
        f"{max(at)} of its epoch; a stream of this kind cannot leave an item out)"
    )
    if _CANNOT in text:
        return ProcessDiedError(text.replace(_CANNOT, note + _CANNOT, 1))
    return ProcessDiedError(text + note)
