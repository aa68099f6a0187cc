"""The loop of a child process: lanes that produce, a listener that reads control messages.

    control channel --> listener thread --> Inbox ------------------------+
                                                                          | applied by lane 0
    lane 0 (main thread)  next(output 0) --> its channel(s)               | once every other
    lane k (thread k)     next(output k) --> its channel(s)  <------------+ lane is parked

Control messages are read by the listener as soon as they arrive, so the main process
never waits long to send one, whatever the lanes are doing. They are *applied* in order
by lane 0 (the process's main thread, where user hooks run) once every other lane is
parked between two items, because they touch DataPipes the lanes may share. The end of
the control stream is the STOP: every lane ends at its next item boundary.

State, and who may touch it:

    Inbox.interrupt   a message waits, or the child stops: lanes park at the next item
                      boundary. Written under the inbox lock; read WITHOUT it by the lanes'
                      hot loop, once per item: a bool read is atomic, a stale False only
                      delays parking by one item, and the write is followed by a
                      notify under the lock, so a lane that parks always sees it.
    Inbox internals   (messages, parked and gone counts, generation) only under its lock.
    ChildLoop.states  LaneState per lane, and ``paused``: written by lane 0 while applying
                      (every other lane parked, so none reads them meanwhile) and by a lane
                      ending its own stream; read by that lane between items.

A lane thread never holds the inbox lock while it produces or writes a channel.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from ...transport import ChannelError, Receiver
from .lanes import Lane, enter_lane
from ..data_messages import RemoteError
from ..control_messages import Received, Reset, Stop, Unreadable
from ..timeline import Span

_JOIN_SECONDS = 5.0


class LaneState(enum.Enum):
    IDLE = "idle"  # no stream for the current epoch (none yet, ended, or failed): parked
    RUNNING = "running"  # producing its stream; parks between two items when interrupted


class Applier(Protocol):
    def apply(self, message: Received, loop: ChildLoop) -> None: ...


class Inbox:
    """Messages from the listener to lane 0, and the parking of the other lanes."""

    def __init__(self, others: int) -> None:
        self.interrupt = False  # read without the lock by the lanes: see the module docstring
        self.stopping = False
        self._others = others  # lanes that must be parked (or gone) before lane 0 applies
        self._messages: deque[Received] = deque()
        self._cv = threading.Condition(threading.Lock())
        self._parked = 0  # lanes parked since the last generation change
        self._gone = 0
        self._generation = 0

    def listen(self, control: Receiver, where: str, announce: Callable[[Received], bool | None] | None) -> None:
        """The listener thread: read every control message as it arrives, until the end."""
        while True:
            try:
                message: Received = control.recv()
            except ChannelError:  # the main process closed its end (STOP), or it is gone
                message = Stop()
            except Exception as exc:  # a message that does not unpickle here
                message = Unreadable(RemoteError.capture(exc, where))
            # Before lane 0 can apply it: its readers need the news first. A message handled
            # there (a ``Redeal``) is not queued: it must not wait for lanes to park.
            if announce is not None and not isinstance(message, Stop) and announce(message):
                continue
            with self._cv:
                if isinstance(message, Stop):
                    self.stopping = True
                else:
                    self._messages.append(message)
                self.interrupt = True
                self._cv.notify_all()
            if isinstance(message, Stop):
                return

    def stop(self) -> None:
        with self._cv:
            self.stopping = self.interrupt = True
            self._cv.notify_all()

    def park(self) -> bool:
        """Lane k > 0: wait until lane 0 has applied what waits. False when stopping."""
        with self._cv:
            generation = self._generation
            self._parked += 1  # counts for this generation only: lane 0 resets it when it moves on
            self._cv.notify_all()
            while self._generation == generation and not self.stopping:
                self._cv.wait(1.0)  # notified by lane 0; a bounded wait re-reads the predicate
            return not self.stopping

    def take(self) -> list[Received] | None:
        """Lane 0: wait for messages and every other lane parked; None when stopping."""
        with self._cv:
            while not self.stopping and not (self._messages and self._parked + self._gone >= self._others):
                self._cv.wait(1.0)  # notified on every change; a bounded wait re-reads the predicate
            if self.stopping:
                return None
            messages = list(self._messages)
            self._messages.clear()
            self.interrupt = False
            return messages

    def applied(self) -> bool:
        """Lane 0, after applying: release the parked lanes. False when stopping."""
        with self._cv:
            self.interrupt = bool(self._messages) or self.stopping
            # A lane woken by this change is no longer parked, even before it runs again.
            self._generation += 1
            self._parked = 0
            self._cv.notify_all()
            return not self.stopping

    def lane_gone(self) -> None:
        with self._cv:
            self._gone += 1
            self._cv.notify_all()

    def parked_or_gone(self) -> int:
        with self._cv:
            return self._parked + self._gone


class ChildLoop:
    """Runs the lanes of one child process and has ``control`` apply its messages.

    ``control.apply(message, loop)`` runs on lane 0 with every other lane parked; it
    moves the epoch on with ``loop.begin_epoch(e)``, starts streams with
    ``loop.start(k, datapipe)`` and may set ``loop.paused``.

    ``epoch`` is the child's only copy of the epoch number: the epoch its lanes produce
    for (their batchers stamp it on every message) and its inputs read (``worker.py``).
    """

    def __init__(
        self,
        control_channel: Receiver,
        lanes: Sequence[Lane],
        control: Applier,
        where: str,
        announce: Callable[[Received], bool | None] | None = None,
    ) -> None:
        self.lanes = tuple(lanes)
        self.where = where
        self.states = [LaneState.IDLE] * len(self.lanes)
        self.skips = [0] * len(self.lanes)  # items lane k still drops before sending (a restore)
        self.epoch = 0
        self.paused = False
        self.inbox = Inbox(len(self.lanes) - 1)
        self._channel = control_channel
        self._control = control
        # Called by the listener with each message as it arrives, before it is applied:
        # lets a worker end an abandoned epoch's reads without waiting for it. A true
        # answer means the message was handled there and is not queued for lane 0.
        self._announce = announce

    # -- what control.apply() uses ---------------------------------------------------------

    def begin_epoch(self, epoch: int) -> None:
        """Move on to ``epoch``: every lane's next messages are stamped with it."""
        self.epoch = epoch
        for k, lane in enumerate(self.lanes):
            self.states[k] = LaneState.IDLE
            self.skips[k] = 0
            lane.set_epoch(epoch)

    def start(self, k: int, datapipe: Any, skip: int = 0, lost: int = -1, careful: int = 0) -> None:
        """Begin lane k's stream, which first drops ``skip`` items (a restored epoch: the
        user had them before the checkpoint), or starts after them through the DataPipe's
        ``resume_from(skip)`` when it has one; a failure to begin is that stream's error.
        ``lost`` >= 0 (a replacement after an item that killed the worker twice): that item
        is left out of the replay, through ``resume_from(skip, lost=...)``, which the main
        process asks for only of a DataPipe that declares ``skips_lost``. ``careful`` (a
        replacement): its first ``careful`` items sent are handed on one by one."""
        lane = self.lanes[k]
        # The documented hook (``resume_from``, checkpoint page): a DataPipe that can start
        # after its first ``skip`` items faster than by producing them says so itself.
        fast = getattr(datapipe, "resume_from", None) if skip else None
        self.skips[k] = 0 if callable(fast) else skip
        try:
            if callable(fast) and lost >= 0:
                stream = fast(skip, lost=lost)
            else:
                stream = fast(skip) if callable(fast) else datapipe
            lane.begin(_handed_on_one_by_one(stream, careful, lane, self.skips, k) if careful else stream)
        except BaseException as exc:  # whatever user code raises is reported: see produce()
            self.states[k] = LaneState.IDLE
            lane.fail(RemoteError.capture(exc, self.where))
            return
        if lane.liveness is not None:  # which item it makes: counted from here (liveness.py)
            lane.liveness.begin_stream(self.epoch, skip if callable(fast) else 0)
        self.states[k] = LaneState.RUNNING

    def fail_all(self, error: RemoteError, every: bool = False) -> None:
        """End the running streams with ``error``; with ``every``, idle lanes too (an epoch
        that could not begin ends with that error on every lane)."""
        for k, lane in enumerate(self.lanes):
            if self.states[k] is LaneState.IDLE and not every:
                continue
            self.states[k] = LaneState.IDLE
            lane.fail(error)

    @property
    def streaming(self) -> bool:
        return any(state is LaneState.RUNNING for state in self.states)

    # -- running ---------------------------------------------------------------------------

    def run(self) -> None:
        listener = threading.Thread(
            target=self.inbox.listen, args=(self._channel, self.where, self._announce), name="mprs_plus control"
        )
        listener.daemon = True
        listener.start()
        threads = [
            threading.Thread(target=self._lane_main, args=(k,), name=f"mprs_plus lane {k}", daemon=True)
            for k in range(1, len(self.lanes))
        ]
        for thread in threads:
            thread.start()
        try:
            self._lane_main(0)
        finally:
            self.inbox.stop()
            for thread in threads:
                thread.join(_JOIN_SECONDS)

    def _lane_main(self, k: int) -> None:
        lane, inbox, states = self.lanes[k], self.inbox, self.states
        enter_lane(lane)
        try:
            while True:
                if states[k] is LaneState.RUNNING and not self.paused and not inbox.interrupt:
                    if self.skips[k]:
                        began = time.perf_counter()
                        ended = skip_items(lane, inbox, self.where, self.skips, k)
                        if lane.stats is not None and lane.stats.trace is not None:  # the timeline's replay
                            lane.stats.trace.span(Span.REPLAY, began, time.perf_counter())
                        if ended:
                            states[k] = LaneState.IDLE
                    elif produce(lane, inbox, self.where):
                        states[k] = LaneState.IDLE  # its stream ended (END or ERROR sent)
                    continue
                lane.flush()
                if not (self._apply_inbox() if k == 0 else inbox.park()):
                    return
        except ChannelError:
            return  # the reader of a channel of this lane is gone: the service is stopping
        finally:
            try:
                lane.close()
            finally:
                inbox.lane_gone()

    def _apply_inbox(self) -> bool:
        messages = self.inbox.take()
        if messages is None:
            return False
        stats = self.lanes[0].stats
        trace = stats.trace if stats is not None else None
        try:
            for message in messages:
                began = time.perf_counter()
                self._control.apply(message, self)
                if trace is not None and isinstance(message, Reset):  # on the timeline: the epoch's set-up
                    trace.span(Span.RESET, began, time.perf_counter(), message.epoch)
        finally:
            going_on = self.inbox.applied()
        return going_on


def _handed_on_one_by_one(items: Any, count: int, lane: Lane, skips: list[int], k: int) -> Iterator[Any]:
    """``items``, the first ``count`` sent (after lane k's skip) each handed on before the
    next is begun."""
    iterator = iter(items)
    for item in iterator:
        dropped = skips[k] > 0  # produced to be dropped (a restore that replays)
        yield item
        if not dropped:
            lane.flush()
            count -= 1
            if count <= 0:
                break
    yield from iterator


def skip_items(lane: Lane, inbox: Inbox, where: str, skips: list[int], k: int) -> bool:
    """Produce lane k's next ``skips[k]`` items and drop them, in this process: a restored
    epoch goes on after the items the user already had, and none of them is sent. Stops
    when interrupted (False, ``skips[k]`` says what is left) or when the stream ends first
    (True: END or ERROR sent)."""
    lock, next_item = lane.lock, lane.next_item
    liveness = lane.liveness
    while skips[k] and not inbox.interrupt:  # unlocked read, as in produce()
        if lock is not None:
            lock.acquire()  # a skipping lane holds no unsent items: waiting here blocks nobody
        try:
            if liveness is not None and liveness.begun is not None:
                liveness.value += 1
                liveness.begun[liveness.slot] = liveness.value
            next_item()
        except StopIteration:
            lane.finish()
            return True
        except BaseException as exc:  # see produce()
            lane.fail(RemoteError.capture(exc, where))
            return True
        finally:
            if lock is not None:
                lock.release()
        skips[k] -= 1
    return False


PUBLISH_EVERY = 0.1  # seconds: the longest a lane's counts wait in it before the shared table sees them


def _take_traced(window: Any, lane: Lane, interrupted: Callable[[], bool], trace: Any) -> bool:
    """``window.take``, its wait on the timeline: the lane is ahead of the loop by its window."""
    began = time.perf_counter()
    taken = window.take(lane.flush, interrupted)
    trace.span(Span.WAIT_WINDOW, began, time.perf_counter())
    return taken


def produce(lane: Lane, inbox: Inbox, where: str) -> bool:
    """Produce ``lane``'s items until interrupted (False) or until its stream ends (True:
    END or ERROR sent)."""
    lock, next_item, emit, stats, window = lane.lock, lane.next_item, lane.emit, lane.stats, lane.window
    trace = stats.trace if stats is not None else None  # the timeline's ring, when recorded
    clock = time.perf_counter
    # While dead workers are replaced: one store per item says which item the lane makes
    # (``liveness.py``), so that a poison sample is known at its first death.
    liveness = lane.liveness
    begun = liveness.begun if liveness is not None else None
    slot = value = 0
    if begun is not None:
        slot, value = liveness.slot, liveness.value

    def interrupted() -> bool:
        return inbox.interrupt

    published = clock()
    try:
        while not inbox.interrupt:  # unlocked read, once per item: see the module docstring
            if window is not None and not (
                window.take(lane.flush, interrupted) if trace is None else _take_traced(window, lane, interrupted, trace)
            ):
                return False  # interrupted while waiting for the main process to hand out an item
            if lock is not None and not lock.acquire(blocking=False):
                lane.flush()  # never wait for the compute lock holding unsent items
                lock.acquire()
            failure: BaseException | None = None
            if begun is not None:
                value += 1
                begun[slot] = value
            started = clock()
            try:
                item = next_item()
            except BaseException as exc:  # StopIteration included: the stream's end
                # SystemExit, KeyboardInterrupt or GeneratorExit raised by user code too: it
                # is reported like any error, never taken for this process's own end (a
                # child ignores SIGINT and is stopped through its control channel).
                failure = exc
            if lock is not None:
                lock.release()
            if failure is not None:
                if stats is not None:
                    stats.sample_memory(at_end=True)  # the first epoch's end, then when due
                    stats.publish()  # before the END: a reader that saw it sees these counts
                if isinstance(failure, StopIteration):
                    lane.finish()
                else:
                    lane.fail(RemoteError.capture(failure, where))
                return True
            if stats is None:
                emit(item)  # an item that cannot be sent becomes an ERROR (batching.py)
                continue
            produced = clock()
            emit(item)
            sent = clock()
            stats.busy += produced - started
            stats.wait_output += sent - produced
            stats.items_out += 1
            if trace is not None:
                trace.item(started, produced, sent, Span.SENDING)
            # Every 64 items, or every PUBLISH_EVERY seconds for slow ones: num_workers="auto"
            # judges windows of a fraction of a second by these counts.
            if not stats.items_out & 63 or produced - published > PUBLISH_EVERY:
                published = produced
                stats.publish()
                stats.sample_memory(due_only=True)
            elif stats.items_out == 1:
                # Where its private memory starts from, unless its start said (forked): after
                # the first item is handed on, so that the sample never delays it.
                stats.sample_start()
        return False
    finally:
        if begun is not None:
            liveness.value = value
        if stats is not None:
            stats.publish()
        if trace is not None:
            trace.flush()
