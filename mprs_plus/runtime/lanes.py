"""The inside of a child process: lanes that produce, and a thread that listens for control.

    control channel --> listener thread --> inbox ------------------------+
                                                                          | applied by lane 0
    lane 0 (main thread)  next(output 0) --> its channel(s)               | once every lane
    lane k (thread k)     next(output k) --> its channel(s)  <------------+ is parked

A child has one *lane* per output: a worker one per worker output (branch), the dispatch
process one per dispatcher. Each lane iterates its own DataPipe and is the only writer of
its own channels, so a full channel stops that lane and nothing else.

Control messages (RESET, PAUSE, RESUME, LIMIT) are read by a listener thread as soon as they
arrive, so the main process never blocks sending one, whatever the lanes are doing. They are
*applied* in order by lane 0 (the process's main thread, where user hooks run) once every
lane is parked between two items, because they touch DataPipes the lanes may share. STOP
ends every lane at its next item boundary, without waiting for the others.

Lane states::

    IDLE     no stream for the current epoch (none yet, ended, or failed) -> parked
    RUNNING  producing; looks at ``interrupt`` between two items
    PARKED   waiting until lane 0 has applied the inbox
    PAUSED   the child is paused: parked until RESUME

Rules that keep a child free of deadlocks:

* a lane never waits (for a lock, an input, a peer) while holding unsent items: it flushes
  its batches first;
* lanes that share DataPipes share a compute lock, held only inside ``next()``, never
  while writing a channel; lanes that share nothing have no lock at all;
* nothing waits for the listener, and the listener waits only on its channel.

A message that cannot be sent (an item that does not pickle) ends that lane's epoch with
an ERROR carrying the reason (``batching.py``), instead of killing the child.

What is left is the one wait a deterministic round-robin cannot avoid (a worker waiting for
its turn of dispatched items while the dispatcher waits for another worker to make room);
``service.py`` states when that cycle cannot close.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..transport import ChannelError
from .batching import Batcher
from .messages import Kind, RemoteError
from .stats import StatsWriter

_JOIN_SECONDS = 5.0

# The lane running in the current thread, so that an input about to block can flush it.
_current = threading.local()


def current_lane_stats() -> StatsWriter | None:
    """The statistics row of the calling thread's lane, if it keeps one."""
    return getattr(_current, "stats", None)


def flush_current_lane() -> None:
    """Send the items the calling thread's lane holds (called before a blocking read)."""
    flush = getattr(_current, "flush", None)
    if flush is not None:
        flush()


def _exhausted() -> Any:
    raise StopIteration


class Lane(Protocol):
    lock: threading.Lock | None  # shared by lanes that share DataPipes; None when alone
    stats: StatsWriter | None  # this lane's row of live statistics; None when not collected

    next_item: Callable[[], Any]
    emit: Callable[[Any], None]

    def begin(self, epoch: int, datapipe: Any) -> None: ...
    def set_epoch(self, epoch: int) -> None: ...
    def finish(self) -> None: ...
    def fail(self, error: RemoteError) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class OutputLane:
    """A worker's lane: items of one output go to one channel, in batches."""

    def __init__(
        self, sender: Any, lock: threading.Lock | None, where: str, max_items: int = 64, stats: StatsWriter | None = None
    ) -> None:
        self.lock = lock
        self.stats = stats
        if stats is not None:
            stats.channels = (sender,)
        self._batcher = Batcher(sender, 0, max_items=max_items, where=where, to="the main process")
        self.emit = self._batcher.add
        self.next_item = _exhausted

    def begin(self, epoch: int, datapipe: Any) -> None:
        self._batcher.epoch = epoch
        self.next_item = _exhausted
        self.next_item = iter(datapipe).__next__

    def set_epoch(self, epoch: int) -> None:
        self._batcher.epoch = epoch

    def finish(self) -> None:
        self._batcher.finish(Kind.END)

    def fail(self, error: RemoteError) -> None:
        self._batcher.finish(Kind.ERROR, error)

    def flush(self) -> None:
        self._batcher.flush()

    def close(self) -> None:
        self._batcher.close()


class DealLane:
    """A dispatch lane: items of one dispatcher go round-robin to one channel per worker."""

    def __init__(
        self,
        senders: Sequence[Any],
        lock: threading.Lock | None,
        where: str,
        max_items: int = 64,
        stats: StatsWriter | None = None,
    ) -> None:
        self.lock = lock
        self.stats = stats
        if stats is not None:
            stats.channels = tuple(senders)
        self._batchers = [
            Batcher(sender, 0, max_items=max_items, where=where, to=f"worker {w}") for w, sender in enumerate(senders)
        ]
        self._adds = [batcher.add for batcher in self._batchers]
        self._count = len(self._adds)
        self._turn = 0
        self.next_item = _exhausted

    def begin(self, epoch: int, datapipe: Any) -> None:
        self.set_epoch(epoch)
        self.next_item = _exhausted
        self.next_item = iter(datapipe).__next__

    def set_epoch(self, epoch: int) -> None:
        for batcher in self._batchers:
            batcher.epoch = epoch
        self._turn = 0

    def emit(self, item: Any) -> None:
        turn = self._turn
        self._adds[turn](item)
        self._turn = turn + 1 if turn + 1 < self._count else 0

    def finish(self) -> None:
        for batcher in self._batchers:
            batcher.finish(Kind.END)

    def fail(self, error: RemoteError) -> None:
        """The error takes the failing item's place in the deal; the other workers end."""
        for offset in range(self._count):
            batcher = self._batchers[(self._turn + offset) % self._count]
            if offset == 0:
                batcher.finish(Kind.ERROR, error)
            else:
                batcher.finish(Kind.END)

    def flush(self) -> None:
        for batcher in self._batchers:
            batcher.flush()

    def close(self) -> None:
        for batcher in self._batchers:
            batcher.close()


class ChildLoop:
    """Runs the lanes of one child process and applies its control messages.

    ``apply(kind, epoch, payload)`` is called on lane 0 with every other lane parked; it
    starts streams with ``start(k, epoch, datapipe)`` and may set ``paused``.
    """

    def __init__(
        self,
        control: Any,
        lanes: Sequence[Lane],
        apply: Callable[[int, int, Any], None],
        where: str,
        announce: Callable[[int, int], None] | None = None,
    ) -> None:
        self.control = control
        # Called by the listener with (kind, epoch) of each message as it arrives, before it
        # is applied: lets a worker end an abandoned epoch's reads without waiting for it.
        self._announce = announce
        self.lanes = tuple(lanes)
        self.where = where
        self._apply = apply
        self.active = [False] * len(self.lanes)
        self.paused = False
        self.interrupt = False  # a control message waits (or STOP): lanes park at the next item boundary
        self.stopping = False
        self._inbox: deque[tuple[int, int, Any]] = deque()
        self._cv = threading.Condition(threading.Lock())
        self._parked = 0  # lanes parked since the last generation change
        self._gone = 0
        self._generation = 0

    # -- what apply() uses -----------------------------------------------------------------

    def start(self, k: int, epoch: int, datapipe: Any) -> None:
        """Begin lane k's stream for ``epoch``; a failure to begin is that stream's error."""
        lane = self.lanes[k]
        try:
            lane.begin(epoch, datapipe)
        except Exception as exc:
            self.active[k] = False
            lane.fail(RemoteError.capture(exc, self.where))
            return
        self.active[k] = True

    def fail_all(self, epoch: int | None, error: RemoteError) -> None:
        """End every lane's stream with ``error`` (for ``epoch`` when given)."""
        for k, lane in enumerate(self.lanes):
            if epoch is not None:
                lane.set_epoch(epoch)
            elif not self.active[k]:
                continue
            self.active[k] = False
            lane.fail(error)

    # -- running ---------------------------------------------------------------------------

    def run(self) -> None:
        threading.Thread(target=self._listen, name="mprs_plus control", daemon=True).start()
        threads = [
            threading.Thread(target=self._lane_main, args=(k,), name=f"mprs_plus lane {k}", daemon=True)
            for k in range(1, len(self.lanes))
        ]
        for thread in threads:
            thread.start()
        try:
            self._lane_main(0)
        finally:
            with self._cv:
                self.stopping = self.interrupt = True
                self._cv.notify_all()
            for thread in threads:
                thread.join(_JOIN_SECONDS)

    def _listen(self) -> None:
        while True:
            try:
                message = self.control.recv()
            except ChannelError:  # the main process closed its end or is gone
                message = (Kind.STOP, 0, None)
            except Exception as exc:  # a message that does not unpickle here
                message = (Kind.ERROR, 0, RemoteError.capture(exc, self.where))
            with self._cv:
                if message[0] == Kind.STOP:
                    self.stopping = True
                else:
                    self._inbox.append(message)
                self.interrupt = True
                self._cv.notify_all()
            if message[0] == Kind.STOP:
                return
            if self._announce is not None:
                self._announce(message[0], message[1])

    def _lane_main(self, k: int) -> None:
        lane = self.lanes[k]
        _current.flush = lane.flush
        _current.stats = lane.stats
        if lane.stats is not None:
            lane.stats.start()
        try:
            while True:
                if self.active[k] and not self.paused and not self.interrupt:
                    self._produce(k, lane)
                    continue
                lane.flush()
                if not (self._apply_inbox() if k == 0 else self._park()):
                    return
        except ChannelError:
            return  # the reader of a channel of this lane is gone: the service is stopping
        finally:
            try:
                lane.close()
            finally:
                with self._cv:
                    self._gone += 1
                    self._cv.notify_all()

    def _produce(self, k: int, lane: Lane) -> None:
        lock = lane.lock
        next_item = lane.next_item
        emit = lane.emit
        stats = lane.stats
        clock = time.perf_counter
        try:
            while not self.interrupt:
                if lock is not None and not lock.acquire(blocking=False):
                    lane.flush()
                    lock.acquire()
                failure: BaseException | None = None
                started = clock()
                try:
                    item = next_item()
                except StopIteration as exc:
                    failure = exc
                except Exception as exc:
                    failure = exc
                if lock is not None:
                    lock.release()
                if failure is not None:
                    self.active[k] = False
                    if stats is not None:
                        stats.publish()  # before the END: a reader that saw it sees these counts
                    if isinstance(failure, StopIteration):
                        lane.finish()
                    else:
                        lane.fail(RemoteError.capture(failure, self.where))
                    return
                if stats is None:
                    emit(item)  # an item that cannot be sent becomes an ERROR (batching.py)
                    continue
                produced = clock()
                emit(item)
                stats.busy += produced - started
                stats.wait_output += clock() - produced
                stats.items_out += 1
                if not stats.items_out & 63:
                    stats.publish()
        finally:
            if stats is not None:
                stats.publish()

    def _park(self) -> bool:
        with self._cv:
            generation = self._generation
            self._parked += 1  # counts for this generation only: lane 0 resets it when it moves on
            self._cv.notify_all()
            while self._generation == generation and not self.stopping:
                self._cv.wait()
            return not self.stopping

    def _apply_inbox(self) -> bool:
        others = len(self.lanes) - 1
        with self._cv:
            while not self.stopping and not (self._inbox and self._parked + self._gone >= others):
                self._cv.wait()
            if self.stopping:
                return False
            messages = list(self._inbox)
            self._inbox.clear()
            self.interrupt = False
        try:
            for kind, epoch, payload in messages:
                self._apply(kind, epoch, payload)
        finally:
            with self._cv:
                self.interrupt = bool(self._inbox) or self.stopping
                # A lane woken by this change is no longer parked, even before it runs again.
                self._generation += 1
                self._parked = 0
                self._cv.notify_all()
        return not self.stopping
