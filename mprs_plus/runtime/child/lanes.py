"""The lanes of a child process: what each produces and where it writes.

A child has one *lane* per output: a worker one per worker output (branch), the dispatch
process one per dispatcher. Each lane iterates its own DataPipe and is the only writer of
its own channels, so a full channel stops that lane and nothing else. ``loop.py`` runs
the lanes and applies control messages between their items.

    OutputLane   worker output k -> one channel to the main process, in batches
    DealLane     dispatcher d -> one channel per worker, round-robin, in batches

Rules that keep a child free of deadlocks:

* a lane never waits (for a lock, an input, a peer) while holding unsent items: it flushes
  its batches first (``flush_current_lane`` lets an input about to block do it);
* lanes that share DataPipes share a compute lock, held only inside ``next()``, never
  while writing a channel; lanes that share nothing have no lock at all;
* nothing waits for the listener, and the listener waits only on its channel.

A worker lane also lends the code it runs memory of its channel to build a large item in
(``borrow_for_current_lane``: a batch stacked straight into the lend area, sent without a
copy; ``transport/_lend.py``, Built in place). Only the lane's own thread gets it: it is
the thread that sends, so the borrowed item goes out through the channel it was lent by.

A message that cannot be sent (an item that does not pickle) ends that lane's epoch with
an ERROR carrying the reason (``batching.py``), instead of killing the child.

What is left is the one wait a deterministic round-robin cannot avoid (a worker waiting for
its turn of dispatched items while the dispatcher waits for another worker to make room);
``service.py`` states when that cycle cannot close.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ...transport import Sender, note_blocking
from .batching import Batcher
from ..data_messages import Kind, RemoteError
from ..liveness import LaneLiveness
from ..stats import StatsWriter
from ..window import ItemWindow

# The lane running in the current thread, so that an input about to block can flush it.
_current = threading.local()


def enter_lane(lane: Lane) -> None:
    """Make ``lane`` the calling thread's lane (its thread runs nothing else)."""
    _current.flush = lane.flush
    _current.stats = lane.stats
    _current.borrow = lane.borrow
    _current.aside = getattr(lane, "send_aside", None)
    if lane.stats is not None:
        lane.stats.start()
    trace = lane.stats.trace if lane.stats is not None else None
    if trace is not None:  # the timeline is recorded: this life's track begins (timeline.py)
        trace.begin()
        note_blocking(trace.sleep_note(lane.liveness.note if lane.liveness is not None else None))
    elif lane.liveness is not None:
        note_blocking(lane.liveness.note)  # its sleeps in channel waits, for a stuck read (liveness.py)


def current_lane_stats() -> StatsWriter | None:
    """The statistics row of the calling thread's lane, if it keeps one."""
    return getattr(_current, "stats", None)


def borrow_for_current_lane(nbytes: int) -> Any | None:
    """A writable buffer of ``nbytes`` in the output channel of the calling thread's lane,
    for an item about to be produced there (see the module's docstring); None at once when
    the thread runs no lane, the lane deals to several channels, or there is no room."""
    borrow = getattr(_current, "borrow", None)
    return None if borrow is None else borrow(nbytes)


def flush_current_lane() -> None:
    """Send the items the calling thread's lane holds (called before a blocking read)."""
    flush = getattr(_current, "flush", None)
    if flush is not None:
        flush()


def send_aside_current_lane(payload: Any) -> bool:
    """Send ``payload`` as a RECORD on the output channel of the calling thread's lane (a
    worker output); False when the thread runs no such lane."""
    aside = getattr(_current, "aside", None)
    if aside is None:
        return False
    aside(payload)
    return True


def _exhausted() -> Any:
    raise StopIteration


class Lane(Protocol):
    lock: threading.Lock | None  # shared by lanes that share DataPipes; None when alone
    stats: StatsWriter | None  # this lane's row of live statistics; None when not collected
    liveness: LaneLiveness | None  # where it says it sleeps in a channel wait; always kept by a service
    window: ItemWindow | None  # items it may produce beyond those handed out (window.py); None: its channel bounds it

    next_item: Callable[[], Any]
    emit: Callable[[Any], None]

    def begin(self, datapipe: Any) -> None: ...
    def set_epoch(self, epoch: int) -> None: ...
    def finish(self) -> None: ...
    def fail(self, error: RemoteError) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...
    def borrow(self, nbytes: int) -> Any | None: ...


class OutputLane:
    """A worker's lane: items of one output go to one channel, in batches."""

    def __init__(
        self,
        sender: Sender,
        lock: threading.Lock | None,
        where: str,
        max_items: int = 64,
        stats: StatsWriter | None = None,
        liveness: LaneLiveness | None = None,
        window: ItemWindow | None = None,
    ) -> None:
        self.lock = lock
        self.stats = stats
        self.liveness = liveness
        self.window = window
        if stats is not None:
            stats.channels = (sender,)
        self._batcher = Batcher(sender, 0, max_items=max_items, where=where, to="the main process")
        self.emit = self._batcher.add
        self.borrow = self._batcher.borrow
        self.next_item = _exhausted

    def begin(self, datapipe: Any) -> None:
        self.next_item = _exhausted
        self.next_item = iter(datapipe).__next__

    def set_epoch(self, epoch: int) -> None:
        self._batcher.epoch = epoch
        if self.window is not None:
            self.window.reopen()

    def finish(self) -> None:
        self._batcher.finish(Kind.END)

    def fail(self, error: RemoteError) -> None:
        self._batcher.finish(Kind.ERROR, error)

    def flush(self) -> None:
        self._batcher.flush()

    def send_aside(self, payload: Any) -> None:
        self._batcher.send_aside(payload)

    def close(self) -> None:
        self._batcher.close()


class DealLane:
    """A dispatch lane: items of one dispatcher go round-robin to one channel per worker."""

    def __init__(
        self,
        senders: Sequence[Sender],
        lock: threading.Lock | None,
        where: str,
        max_items: int = 64,
        stats: StatsWriter | None = None,
        liveness: LaneLiveness | None = None,
    ) -> None:
        self.lock = lock
        self.stats = stats
        self.liveness = liveness
        self.window = None  # a dispatcher is bounded by its channels to the workers
        self._where, self._max_items = where, max_items  # for the batchers of later channels (redeal.py)
        if stats is not None:
            stats.channels = tuple(senders)
        self._batchers = [
            Batcher(sender, 0, max_items=max_items, where=where, to=f"worker {w}") for w, sender in enumerate(senders)
        ]
        self._adds = [batcher.add for batcher in self._batchers]
        self._count = len(self._adds)
        self._turn = 0
        self.next_item = _exhausted

    def begin(self, datapipe: Any) -> None:
        self._turn = 0
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

    def borrow(self, nbytes: int) -> None:
        return None  # which worker's channel an item goes to is known only once it is made

    def close(self) -> None:
        for batcher in self._batchers:
            batcher.close()
