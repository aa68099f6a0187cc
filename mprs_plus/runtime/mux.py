"""Read several channels as one, holding at most one message per channel.

    channel 0 --\\
    channel 1 ---> ChannelMux --take(i, epoch)-------> the next message of channel i
    channel 2 --/            --take_any(ids, epoch)--> (i, message), whichever is ready first

Why the channels are read together rather than one by one: a producer blocked on a full
channel that holds data of an *abandoned* epoch must never wait for a reader that is waiting
somewhere else. So whenever a reader is about to block, it also reads every channel that has
no message held: a message of an older epoch is dropped on sight, a current one is held (one
per channel, so memory stays bounded by one message per channel). A message of a newer epoch
ends the reader of the older epoch and stays held for the next reader.

The main process uses one mux over all worker outputs; a worker uses one over its
dispatched inputs. Several threads may take from one mux (the lanes of a worker): one of
them *pumps* (waits on the channels) at a time, the others wait on a condition and find
their message held when woken. Before a thread waits in any way it calls ``before_block``,
so that it never waits while holding items a peer may be waiting for.

Which channels a pump waits on. A channel that has delivered a message of the newest
epoch can hold no stale message any more (a producer's epochs only grow), so a pump need
not wake for it unless some thread wants its next message. A mux given ``wake`` therefore
waits on the idle channels that a taker wants or that are not known to be current yet,
and a thread that comes to want a channel outside the running pump's set interrupts the
pump with ``wake`` (as ``advance`` does), so that it is waited on at once. An in-order
reader then sleeps until *its* worker's item arrives, instead of waking for every other
worker's item in between: fewer sleeps and less main-process CPU per large item (figures
in docs/benchmarks-history.md, Design figures). A mux without ``wake`` waits on every idle channel.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any

from ..transport import Receiver

Message = tuple[int, int, Any]  # (kind, epoch, payload)

# The epoch of the message a mux holds for a channel whose sender has finished for good:
# newer than every epoch, so every reader of that channel ends at once.
CLOSED_EPOCH = sys.maxsize
_NONE: frozenset[int] = frozenset()
RECHECK = 1.0  # seconds a taker waits for the pumping thread before it looks again


class WakePipe:
    """What a mux's ``wake`` writes to and its pump's wait also waits on: ``fd`` is
    readable from ``wake()`` until the woken pump calls ``clear()``. Never blocks, and
    harmless after ``close()`` (a wake-up then has nobody left to wake)."""

    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)

    def wake(self) -> None:
        try:
            os.write(self._write_fd, b"\0")
        except OSError:
            pass  # full of wake-ups already (the pump wakes anyway), or closed

    def clear(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except OSError:
            pass  # empty

    def close(self) -> None:
        """Idempotent: the numbers are forgotten, so that a second close, or a late wake,
        never touches a descriptor that reused them."""
        for fd in (self.fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self.fd = self._write_fd = -1


class ChannelMux:
    """``recv(i)`` reads channel i (it is ready); ``wait(ids)`` blocks until some of the
    channels ``ids`` are ready and returns those (it raises when a peer is known dead)."""

    def __init__(
        self,
        receivers: Sequence[Receiver],
        recv: Callable[[int], Message],
        wait: Callable[[list[int]], list[int]],
        wake: Callable[[], None] | None = None,
    ) -> None:
        self._receivers = list(receivers)
        # Whether a channel has a message, without a system call where the transport
        # offers that look (a gone sender shows in the pump's wait instead).
        self._has_input = [r.has_input for r in self._receivers]
        self._wake = wake  # interrupts a pumping thread's wait (see ``advance``)
        self._recv = recv
        self._wait = wait
        self._held: list[Message | None] = [None] * len(self._receivers)
        # ``with self._lock`` where only the lock is needed: the Condition's own
        # ``__enter__`` is a Python-level call, paid on every item.
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._pumping = False
        self._turn = 0
        # See "Which channels a pump waits on" in the module's docstring.
        self._current = [False] * len(self._receivers)  # delivered a message of ``newest``
        self._wanted = [0] * len(self._receivers)  # takers waiting for each channel now
        self._pump_set: frozenset[int] = _NONE
        self._sleepers = 0  # threads waiting on the condition for the pumping one
        # The newest epoch announced by the owner of the epoch (``MainReader`` in the main
        # process, a child's control listener in a worker): a watermark, not the epoch
        # anyone reads. Messages of older epochs are dropped; readers of older epochs end.
        self.newest = 0

    def drop_held(self) -> None:
        """Forget every message held (a stop: no reader is left to take them). Their items
        may be views of a channel's shared memory, which they keep mapped."""
        with self._lock:
            self._held = [None] * len(self._receivers)

    def replace(self, index: int, receiver: Receiver) -> None:
        """Channel ``index`` reads ``receiver`` from now on (its sender died and a new one
        took over). Called by the thread that reads, between two of its own calls; a
        message held from the old channel stays held: its items were received."""
        self._receivers[index] = receiver
        self._has_input[index] = receiver.has_input
        self._current[index] = False

    def advance(self, epoch: int) -> None:
        """Epoch ``epoch`` has been announced (from another thread, before it is applied):
        end the readers of older epochs and drop their messages now. Waiting for the new
        epoch to be applied could deadlock: a producer blocked on a full channel of the old
        epoch may be what keeps it from being applied."""
        with self._cv:
            if epoch <= self.newest:
                return
            self.newest = epoch
            self._current = [False] * len(self._receivers)  # each may hold the old epoch's messages
            self._cv.notify_all()
        if self._wake is not None:
            self._wake()

    def take(self, index: int, epoch: int, before_block: Callable[[], None] | None = None) -> Message | None:
        """The next message of channel ``index`` for ``epoch``; None when that epoch is over
        for this channel (a newer epoch began, or the sender closed the channel)."""
        held = self._held
        wants: tuple[int, ...] = ()
        with self._lock:
            try:
                while True:
                    if epoch < self.newest:
                        return None
                    message = held[index]
                    if message is None:
                        if not self._pumping and self._has_input[index]():
                            message = self._recv(index)
                            self._note_current(index, message)
                        elif before_block is not None:
                            self._call_unlocked(before_block)
                            before_block = None
                            continue
                        else:
                            if not wants:
                                wants = self._want((index,))
                            self._pump_or_wait()
                            continue
                    else:
                        held[index] = None
                    if message[1] < self.newest:
                        continue  # left over from an abandoned epoch
                    if message[1] > epoch:
                        held[index] = message  # for the reader of that epoch
                        return None
                    return message
            finally:
                self._unwant(wants)

    def take_any(
        self, indices: Collection[int], epoch: int, before_block: Callable[[], None] | None = None
    ) -> tuple[int, Message | None]:
        """``(i, message)`` for the first channel of ``indices`` with a message for ``epoch``,
        or ``(i, None)`` for one whose epoch is over (see ``take``)."""
        held = self._held
        order = sorted(indices)
        wants: tuple[int, ...] = ()
        with self._lock:
            try:
                while True:
                    if epoch < self.newest:
                        return order[0], None
                    # Start the scan where the last one stopped, so no channel starves.
                    start = self._turn % len(order)
                    for index in order[start:] + order[:start]:
                        message = held[index]
                        if message is None:
                            continue
                        held[index] = None
                        if message[1] < self.newest:
                            continue
                        self._turn = start + 1
                        if message[1] > epoch:
                            held[index] = message
                            return index, None
                        return index, message
                    if before_block is not None:
                        self._call_unlocked(before_block)
                        before_block = None
                        continue
                    if not wants:
                        wants = self._want(order)
                    self._pump_or_wait()
            finally:
                self._unwant(wants)

    def _want(self, indices: Sequence[int]) -> tuple[int, ...]:
        """With the lock held: count this taker as waiting for ``indices`` until ``_unwant``,
        and interrupt a running pump that does not wait on all of them."""
        wanted = self._wanted
        for index in indices:
            wanted[index] += 1
        if self._pumping and self._wake is not None and not self._pump_set.issuperset(indices):
            self._wake()
        return tuple(indices)

    def _unwant(self, indices: tuple[int, ...]) -> None:
        wanted = self._wanted
        for index in indices:
            wanted[index] -= 1

    def _note_current(self, index: int, message: Message) -> None:
        if message[1] >= self.newest:
            self._current[index] = True

    def _call_unlocked(self, fn: Callable[[], None]) -> None:
        # The release is inside the ``try``: a signal's exception (Ctrl-C) raised as it
        # returns must still find the lock re-acquired, for the caller's ``with`` to
        # release it (outside, that ``with`` released an unlocked lock, and the user saw
        # a RuntimeError instead of the KeyboardInterrupt).
        try:
            self._cv.release()
            fn()
        finally:
            self._cv.acquire()

    def _pump_or_wait(self) -> None:
        """Called with the lock held. Pump if nobody does, else wait for the pumping thread."""
        if self._pumping:
            self._sleepers += 1
            try:
                self._cv.wait(RECHECK)  # the pump notifies; the caller's loop looks again either way
            finally:
                self._sleepers -= 1
            return
        self._pumping = True
        held = self._held
        for index, message in enumerate(held):
            if message is not None and message[1] < self.newest:
                held[index] = None  # held when it was current; its producer may be blocked behind it
        if self._wake is not None:  # see "Which channels a pump waits on"
            wanted, current = self._wanted, self._current
            idle = [i for i, message in enumerate(held) if message is None and (wanted[i] or not current[i])]
        else:
            idle = [i for i, message in enumerate(held) if message is None]
        self._pump_set = frozenset(idle)
        got: list[tuple[int, Message]] = []
        try:
            self._cv.release()  # inside the ``try``: see ``_call_unlocked``
            for index in self._wait(idle):
                message = self._recv(index)
                # Drain a run of stale messages at once: their producer is waiting on them.
                while message[1] < self.newest and self._receivers[index].poll():
                    message = self._recv(index)
                got.append((index, message))
        finally:
            self._cv.acquire()
            for index, message in got:
                if message[1] >= self.newest:
                    self._held[index] = message
                    self._current[index] = True
            self._pumping = False
            self._pump_set = _NONE
            if self._sleepers:  # nobody to notify, as for the lone reader of the main process
                self._cv.notify_all()
