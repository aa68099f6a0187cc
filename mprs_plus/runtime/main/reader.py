"""The main process's reading side: the epoch, one mux over every worker output, and the
reads of one output in order or as ready (``cursor.py``).

    worker w, output k --data--> receiver --+
                                            +--> ChannelMux --> read_in_order / read_as_ready
    (every worker, every output) -----------+        ^                 |
                                                     |                 v
                    MainChannels.recv / wait --------+        WorkerReader k (main segment)

``MainReader`` is the only owner of the epoch number in the main process: ``begin_epoch``
moves it on and hands it to the supervisor for the ``Reset`` messages; the mux ends readers of
older epochs. Every read goes through the read gate (``gate.py``): a read after the stop,
or one that a stop from another thread interrupts, raises ``ServiceClosedError``, never an
internal error of a closed channel.

``MainChannels`` holds what the mux calls back into; it references neither the reader nor
the facade, so no reference cycle keeps a dropped service alive until a garbage collection.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

from ...errors import PipelineStuckError, ServiceClosedError
from ...transport import ChannelBroken, ChannelError, EndOfStream, Receiver, wait_readable
from ...transport.channel import Waitable
from .gate import CLOSED_MESSAGE, ReadGate
from ..mux import ChannelMux, Message
from .cursor import ReadCursor, read_as_ready, read_in_order
from ..stats import StatsWriter
from ..timeline import Span
from .topology import ChildLink, Topology
from .lifecycle import DEATH_GRACE
from ..data_messages import Kind
from ...segment import Segment
from multiprocessing.connection import wait
from ..window import ItemWindow

_LOG = logging.getLogger("mprs_plus")

# An in-order read that waits two of these spans for one worker, the second one while
# every other worker sits on unread output and writes nothing more, is looked at: a
# warning, or PipelineStuckError when every process sleeps (``_wait_watching``). A read
# that starves raises at most two spans after the cycle closed: well within 15 s.
STUCK_SECONDS = 4.0


class MainChannels:
    """``recv(i)`` and ``wait(ids)`` over the main process's data receivers, for the mux."""

    def __init__(
        self,
        topology: Topology,
        gate: ReadGate,
        death_error: Callable[[], Exception],
        timeout: float | None,
        stats: StatsWriter | None,
        asleep_for: Callable[[float], bool] | None = None,
        replace: Callable[[ChildLink, int, tuple[int, ...]], tuple[list[Any], ...]] | None = None,
        records: Mapping[int, Any] | None = None,
        death_grace: float = DEATH_GRACE,
    ) -> None:
        pairs = topology.data_receivers()
        self.receivers = [receiver for _, receiver in pairs]
        self._worker_of = [link.index for link, _ in pairs]
        self._topology = topology
        self._sentinels: list[int] | None = None  # read at the first wait: children may start after this
        self._gate = gate
        self._death_error = death_error
        self._timeout = timeout
        self._stats = stats
        self._outputs = topology.outputs
        # Only a dispatcher can starve a worker because another one is blocked: without
        # one, each worker reads its own source and a long wait is a slow worker.
        self._watch_stuck = topology.dispatch is not None and len(topology.workers) > 1
        self._stuck_worker: int | None = None  # the worker of the last wait found stuck
        # Whether every child's lane has slept in one channel wait for so many seconds
        # (``Liveness.asleep_for``, kept whatever the statistics options). With one worker
        # output the main process has one reader, so that and its own wait prove the cycle closed.
        self._asleep_for = asleep_for if topology.outputs == 1 else None
        # Replacing dead workers (``replacement.py``): ``replace(link, epoch, received)``
        # starts a new worker for ``link`` and returns, per lane, items to deliver first.
        # Until then a death is the error. Items received per channel this epoch are
        # counted only when replacements are allowed: [epoch, items].
        self._replace = replace
        self._received: list[list[int]] | None = [[0, 0] for _ in self.receivers] if replace else None
        self._fresh: dict[int, list[Any]] = {}  # channels replaced: their first message, due
        # Workers that send their generator records on their data channel (Ray actors):
        # each worker's ``generators.ReceivedRecords``, kept as RECORD messages are read.
        self._records = records
        self._death_grace = death_grace  # seconds a child whose channel broke may take to be known dead
        self.epoch = 0  # the main process's current epoch (``MainReader.begin_epoch``)
        # The mux to tell of a replaced channel, by weak reference: the mux holds this
        # object's ``recv`` and ``wait``, and a cycle would outlive the service.
        self.mux: weakref.ref[ChannelMux] | None = None

    def recv(self, index: int) -> Message:
        if self._fresh:
            first = self._fresh.pop(index, None)
            if first is not None:
                return (Kind.ITEMS, self.epoch, first)
        try:
            if self._stats is None:
                message = self.receivers[index].recv()
            else:
                started = time.perf_counter()  # a message's items are rebuilt in one go: timed per message
                message = self.receivers[index].recv()
                ended = time.perf_counter()
                self._stats.receiving += ended - started
                if self._stats.trace is not None:
                    self._stats.trace.span(Span.RECEIVING, started, ended)
        except (ChannelBroken, EndOfStream) as exc:
            if self._replace_dead():
                return self.recv(index)
            raise self._death_error() from exc
        except ChannelError as exc:
            raise ServiceClosedError("the reading service was shut down during iteration") from exc
        received = self._received
        if received is not None:
            kind = message[0]
            if kind == Kind.ITEMS and message[1] == self.epoch:
                count = received[index]
                if count[0] != self.epoch:
                    count[0], count[1] = self.epoch, 0
                count[1] += len(message[2])
            elif kind == Kind.RECORD:
                self._keep_record(index, message)
                return (Kind.ITEMS, message[1], [])  # nothing for the reader: it reads on
        return message

    def begin_epoch(self, epoch: int, consumed: Sequence[int] = ()) -> None:
        """Move on to ``epoch``; a restored one counts ``consumed[w]`` items of worker w
        (its first output) as received: they are the items its stream skips, and a
        replacement must skip them too."""
        self.epoch = epoch
        if self._received is not None:
            for worker, items in enumerate(consumed):
                self._received[worker * self._outputs] = [epoch, items]

    def _keep_record(self, index: int, message: Message) -> None:
        if self._records is not None:
            self._records[self._worker_of[index]].add(message[1], message[2])

    def _replace_dead(self, grace: float | None = None) -> list[ChildLink]:
        """Replace every dead worker, if replacements are allowed, and return them (none: the
        caller raises the death error). Raises the user's error when one cannot be replaced."""
        if self._replace is None:
            return []
        links = self._topology.started()
        # A process's sentinel fires as it exits, a moment before it can be reaped, and its
        # channel can break a moment before that: give it that moment (``lifecycle.death_error``;
        # a Ray actor's death is known once Ray reports it, its placement's ``death_grace``).
        ready = wait([link.process.sentinel for link in links], self._death_grace if grace is None else grace)
        for link in links:
            if link.process.sentinel in ready:
                link.process.join(DEATH_GRACE)
        dead = [link for link in links if link.process.exitcode is not None]
        if not dead or any(link.role is not Segment.WORKER for link in dead):
            return []  # a dispatch process is not replaced: its death is the error
        lanes = self._outputs
        for link in dead:
            first = link.index * lanes
            # What the dead worker sent and this process has not read yet is read now: it
            # reaches the loop before what the replacement makes.
            left = [self._drain(first + k) for k in range(lanes)]
            received = tuple(
                count[1] if count[0] == self.epoch else 0 for count in self._received[first : first + lanes]
            )
            items = self._replace(link, self.epoch, received)
            for k in range(lanes):
                index = first + k
                self.receivers[index] = link.data[k]
                mux = self.mux() if self.mux is not None else None
                if mux is not None:
                    mux.replace(index, link.data[k])
                self._fresh[index] = left[k] + items[k]
                self._received[index] = [self.epoch, received[k] + len(items[k])]
        self._sentinels = None
        return dead

    def _wait_watching(self, receivers: list[Receiver], index: int, also: list[Waitable]) -> list[Any]:
        """``wait_readable`` of one channel, in slices of ``STUCK_SECONDS``. After a slice
        (not the first) in which every other worker's channel of the same output held unread
        messages and gained none, the wait looks like the cycle described in ``service.py``,
        which an in-order read cannot leave:

        * if every child's lane has slept in a channel wait for the whole slice, nothing
          can wake anyone but this read: ``PipelineStuckError``;
        * otherwise (a lane computes) a warning, once per wait,
          and the wait goes on: a worker that is only slow delivers, and ``timeout``
          still ends it (with the same advice). Later slices look again."""
        worker = self._worker_of[index]
        others = [r for r in self._topology.receivers_of(index % self._outputs) if r is not receivers[0]]
        timeout = self._timeout
        start = time.monotonic()
        written: list[int] | None = None  # looked at only once a slice has passed: no cost per item
        marked = False  # the watchdog's suspicion is on the timeline (when one is recorded)
        self._stuck_worker = None
        while True:
            left = None if timeout is None else timeout - (time.monotonic() - start)
            span = STUCK_SECONDS if left is None else max(0.0, min(left, STUCK_SECONDS))
            ready = wait_readable(receivers, span, also=also)
            if ready or (left is not None and left <= span):
                return ready
            traffic = [receiver.traffic() for receiver in others]
            if written is not None and all(
                now.queued_messages and now.messages == before for now, before in zip(traffic, written)
            ):
                if self._stats is not None and self._stats.trace is not None and not marked:  # on the timeline
                    marked, now = True, time.perf_counter()
                    self._stats.trace.write(Span.WATCHDOG, now, now, worker)
                if self._asleep_for is not None and self._asleep_for(span):
                    raise PipelineStuckError(
                        f"worker {worker}'s next item can never come: the main process has waited "
                        f"{time.monotonic() - start:.0f} s for it, and every process of the reading service has "
                        f"slept for at least {span:g} s waiting for another: the worker is starved of input. "
                        + _STUCK_ADVICE
                    )
                if self._stuck_worker is None:
                    self._stuck_worker = worker
                    _LOG.warning(
                        "mprs_plus: the main process has waited %.0f s for worker %d's next item, while every "
                        "other worker has items waiting to be read and has written none since. %s%s",
                        time.monotonic() - start,
                        worker,
                        _STUCK_ADVICE,
                        _ONLY_SLOW,
                    )
            written = [now.messages for now in traffic]

    def _children(self) -> list[int]:
        """The children's sentinels; kept once every child is started (under fork they
        start with the first epoch, after this object is made)."""
        if self._sentinels is not None:
            return self._sentinels
        started = self._topology.started()
        sentinels = [link.process.sentinel for link in started]
        if len(started) == len(list(self._topology.children())):
            self._sentinels = sentinels
        return sentinels

    def _drain(self, index: int) -> list[Any]:
        """The items of the current epoch still in channel ``index``, whose sender died,
        counted as received. Messages of other epochs, its end and its errors are dropped:
        the replacement makes them again."""
        receiver, count = self.receivers[index], self._received[index]
        items: list[Any] = []
        while True:
            try:
                if not receiver.poll():
                    break
                kind, epoch, payload = receiver.recv()
            except Exception:  # the gone sender's end of the stream, or a message cut short
                break
            if kind == Kind.ITEMS and epoch == self.epoch:
                items.extend(payload)
            elif kind == Kind.RECORD:
                self._keep_record(index, (kind, epoch, payload))
        if count[0] != self.epoch:
            count[0], count[1] = self.epoch, 0
        count[1] += len(items)
        return items

    def wait(self, indices: list[int]) -> list[int]:
        """Block until some of the channels ``indices`` are readable. A child that died
        meanwhile is an error, a stop is ``ServiceClosedError``, and a wait longer than
        ``timeout`` is a TimeoutError."""
        gate = self._gate
        gate.check()
        if self._fresh:
            fresh = [i for i in indices if i in self._fresh]
            if fresh:
                return fresh
        receivers = [self.receivers[i] for i in indices]
        asked = time.perf_counter()
        also = [*self._children(), gate.wake_fd, gate.nudge_fd]
        if self._watch_stuck and len(indices) == 1:
            ready = self._wait_watching(receivers, indices[0], also)
        else:
            ready = wait_readable(receivers, self._timeout, also=also)
        if self._stats is not None:
            waited = time.perf_counter()
            self._stats.wait_input += waited - asked
            if self._stats.trace is not None:
                self._stats.trace.span(Span.WAIT_INPUT, asked, waited)
        gate.check()  # a stop from another thread woke us up
        if len(ready) == 1 and ready[0] is receivers[0] and len(indices) == 1:
            return indices  # the usual wake-up of an in-order reader: its worker's item came
        nudged = gate.nudge_fd in [r for r in ready if isinstance(r, int)]
        if nudged:
            gate.clear_nudge()  # another thread wants a channel not waited on here: the mux asks again
        if not ready:
            workers = sorted({self._worker_of[i] for i in indices})
            if self._stuck_worker in workers:
                raise TimeoutError(
                    f"no item from worker {self._stuck_worker} within timeout={self._timeout} s. "
                    + _STUCK_ADVICE
                    + _ONLY_SLOW
                )
            raise TimeoutError(
                f"no item from worker {', '.join(map(str, workers))} within timeout={self._timeout} s; the workers "
                "are alive. Raise the timeout if items are this slow, or look for a stuck read in the pipeline."
            )
        index_of = {id(receiver): i for receiver, i in zip(receivers, indices)}
        found = [index_of[id(r)] for r in ready if id(r) in index_of]
        if not found and not nudged:
            if self._replace_dead():
                return [i for i in indices if i in self._fresh]
            raise self._death_error()
        return found


_STUCK_ADVICE = (
    "Read in order (in_order=True, the default), the main process must take that worker's item next. If the worker "
    "is starved of input, the wait never ends: the dispatcher is blocked on another worker's full input, and that "
    "worker on its output, which waits for the main process. A stage after the dispatcher that keeps far more items "
    "on some workers than on others (a filter, a flat-map) leads there. Pass in_order=False to read whichever worker "
    "is ready, or balance that stage."
)
_ONLY_SLOW = " If the worker is only slow, its item will come."


class GatedMux:
    """The mux's ``take`` and ``take_any``, each inside the read gate."""

    def __init__(self, mux: ChannelMux, gate: ReadGate) -> None:
        self._mux = mux
        self._gate = gate

    def take(self, index: int, epoch: int) -> Message | None:
        gate = self._gate
        gate.enter()
        try:
            return self._mux.take(index, epoch)
        finally:
            gate.leave()

    def take_any(self, indices: Collection[int], epoch: int) -> tuple[int, Message | None]:
        gate = self._gate
        gate.enter()
        try:
            return self._mux.take_any(indices, epoch)
        finally:
            gate.leave()


class MainReader:
    """The epoch and the reads of the main process (see the module docstring)."""

    def __init__(
        self,
        topology: Topology,
        gate: ReadGate,
        death_error: Callable[[], Exception],
        interrupted: Callable[[], None],
        in_order: bool,
        timeout: float | None,
        stats: StatsWriter | None,
        asleep_for: Callable[[float], bool] | None = None,
        windows: Mapping[int, ItemWindow] | None = None,
        replace: Callable[[ChildLink, int, tuple[int, ...]], tuple[list[Any], ...]] | None = None,
        records: Mapping[int, Any] | None = None,
        death_grace: float = DEATH_GRACE,
    ) -> None:
        channels = MainChannels(
            topology, gate, death_error, timeout, stats, asleep_for, replace, records, death_grace
        )
        self.epoch = 0
        self._mux = ChannelMux(channels.receivers, channels.recv, channels.wait, gate.nudge)
        channels.mux = weakref.ref(self._mux)
        self._main_channels = channels
        self._take = GatedMux(self._mux, gate)
        self._gate = gate
        self._interrupted = interrupted  # Ctrl-C in a read: stop the children before unwinding
        self._read = read_in_order if in_order else read_as_ready
        # The mux's channel index of (worker w, output k), by output.
        position = {id(receiver): i for i, receiver in enumerate(channels.receivers)}
        self._channels = [
            [position[id(receiver)] for receiver in topology.receivers_of(k)] for k in range(topology.outputs)
        ]
        # Per output, each worker's item window, told of every item handed out (window.py).
        self._credits: list[list[Callable[[], None]] | None] = [
            [windows[id(receiver)].handed for receiver in topology.receivers_of(k)] if windows else None
            for k in range(topology.outputs)
        ]
        # What each output's reader handed out this epoch (checkpoints); None before the first.
        self.cursors: list[ReadCursor | None] = [None] * topology.outputs
        self._handed_before = 0  # items handed out in earlier epochs

    def begin_epoch(self, next_worker: int = 0, consumed: Sequence[int] = ()) -> int:
        """Move on to the next epoch: readers of the previous one end, its leftovers are dropped.
        A restored epoch goes on where it stopped: ``next_worker``'s turn comes first, and
        ``consumed[w]`` items of worker w count as handed out."""
        self._gate.check()
        self.epoch += 1
        self._main_channels.begin_epoch(self.epoch, consumed)
        self._mux.advance(self.epoch)
        self._handed_before = self.handed_out()
        self.cursors = [
            ReadCursor(len(channels), next_worker, consumed, credits)
            for channels, credits in zip(self._channels, self._credits)
        ]
        return self.epoch

    def drop_held(self) -> None:
        """The stop owns the receivers (no reader is inside): forget what was read from them
        and not handed out, the first messages of replacements included."""
        self._mux.drop_held()
        self._main_channels._fresh.clear()

    def replace_dead(self) -> list[Any]:
        """Between epochs: replace the workers found dead now (none when replacements are off)."""
        return self._main_channels._replace_dead(grace=0.0)

    def iterate(self, branch: int) -> Iterator[Any]:
        """The current epoch's items of worker output ``branch``."""
        self._gate.check()
        items = self._read(self._take, self._channels[branch], self.epoch, self.cursors[branch])
        return _guarded(items, self._gate, self._interrupted)

    def handed_out(self) -> int:
        """Items handed to the main segment since the service started, every output
        together: the statistics' count, read off the cursors that checkpoints read."""
        return self._handed_before + sum(cursor.handed() for cursor in self.cursors if cursor is not None)


def _guarded(items: Iterator[Any], gate: ReadGate, interrupted: Callable[[], None]) -> Iterator[Any]:
    """Let no internal error of a stopped service reach the user."""
    lifecycle = gate.lifecycle
    iterator = iter(items)
    held: list[Any] = []  # the item being handed out: no local keeps it past its yield (cursor.py, handed_on)
    try:
        while True:
            try:
                held.append(next(iterator))
            except StopIteration:
                break
            if lifecycle.closed:  # items already read when the service was shut down are not handed out
                raise ServiceClosedError(CLOSED_MESSAGE)
            yield held.pop()
        gate.check()
    except GeneratorExit:
        # Closed unfinished: by its owner, or at interpreter exit, when this module's
        # globals (the exception types below) may already be gone. Nothing to translate.
        raise
    except KeyboardInterrupt:
        # Ctrl-C: the children ignore SIGINT and wait for us; end them before unwinding.
        interrupted()
        raise
    except ServiceClosedError:
        raise
    except Exception as exc:
        if gate.closed:
            raise ServiceClosedError(CLOSED_MESSAGE) from exc
        raise
