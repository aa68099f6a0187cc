"""The channel interface, declared once: what the runtime may call on an endpoint, and how
one thread waits for any of several receivers, whatever carries their messages.

    Sender                                   Receiver
      send(obj, timeout=None)                  recv(timeout=None) -> obj
      peer_waiting() -> bool                   skip() -> bool
      watch(*waitables)                        poll() -> bool, has_input() -> bool
      traffic() -> Traffic                     watch(*waitables), traffic()
      borrow(nbytes) -> buffer | None
      close(), release()                       close(), release()
                                               wait(timeout, also)           one receiver
                                               arm() / disarm(woken, ...)    several at once

Every implementation keeps the same contract: a channel holds at most ``capacity_items``
messages and about ``capacity_bytes`` bytes (a larger message goes alone), a full channel
blocks its sender (backpressure), and an endpoint stops delivering in the three ways of
``errors.py``: ``ChannelClosed`` (closed here), ``ChannelBroken`` (the peer is gone, or a
watched waitable became ready while blocked), ``EndOfStream`` (closed cleanly by the
sender, after every message). A wait that runs out raises ``TimeoutError`` and leaves the
channel as it was. An endpoint has one owner thread at a time.

Waiting for several receivers (``wait_readable``)
    One receiver waits its own way (``Receiver.wait``: the shared-memory receiver spins
    first, a pipe asks the kernel). Several, possibly of different transports, wait
    together by this protocol, the one ``_wakeup.py`` states for one ring, over all of them:

        waiter (wait_together)                      sender of receiver r
        1 look: any r.has_input()? done             publish the message (or the end)
          (then look again for up to SPIN_SECONDS:
          ``_spin``, looks only, as a ring's own wait spins)
        2 w_r = r.arm() for every r                 if r is armed: make w_r readable
        3 look again: any r.has_input()? done
        4 block on every w_r that is not None and on ``also``, for at most
          RECHECK_SECONDS (less while some w_r is None: see below)
        5 r.disarm(woken=w_r was readable) for every r, then look: r.poll()

    A sender wakes its receiver's waiter only while that receiver is armed; the transport
    makes the arm (2) and the sender's publish-then-look a pair in which one of the two
    always sees the other (a fence in the rings, the kernel's own ordering in a pipe), so
    a message published after look 3 always makes its waitable readable. A waitable may
    be consumed (drained) only in ``disarm(woken=True)``, before the look of step 5, never
    elsewhere: a wake-up consumed later could belong to a message that look did not see.

    The block is bounded whatever happens: a lost wake-up (a bug) costs at most
    ``RECHECK_SECONDS`` of latency, never a hang, and ``disarm(timed_out=True)`` lets a
    transport count such a rescue (``Traffic.rescues``). A receiver that has no waitable
    to give (``arm()`` returns None: a queue between threads) is simply looked at again:
    the block then lasts ``FALLBACK_SECONDS`` at first, doubling up to
    ``FALLBACK_MAX_SECONDS`` while nothing arrives, so such a
    receiver is served within that interval and an idle one costs some tens of wake-ups a
    second (a transport that cares gives a waitable instead).

    The ``also`` waitables (process sentinels, a mux's wake-up pipe: descriptors, or
    objects with ``fileno()``) end the wait as soon as they are readable; they are
    returned among the ready ones.

Writing a new transport
    Implement the two protocols below; ``arm`` may return None and ``wait`` may be
    ``wait_together([self], timeout, also)``. The runtime calls nothing else, and needs no
    change. Handing endpoints to another process, ``release_all_except`` and ``lending``
    are the business of each transport's ``open_channel``, outside this interface.
"""

from __future__ import annotations

import math
import os
import select
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

from . import _wakeup
from ._wakeup import asleep
from .traffic import Traffic


class HasFileno(Protocol):
    def fileno(self) -> int: ...


# What a wait can block on: a descriptor, or an object with ``fileno()`` (a process
# sentinel is an int, a ``Connection`` has ``fileno``).
Waitable = int | HasFileno

# The longest a waiter blocks before it looks at its receivers again (step 4 above): the
# same interval as the rings' watchdog, so a rescue is counted the same way in both waits.
RECHECK_SECONDS = _wakeup.WATCHDOG_SECONDS
# The first block while some receiver cannot wake its waiter, doubled while nothing comes
# up to the last: the latency such a receiver may add, against the waiter's idle wake-ups.
FALLBACK_SECONDS = 0.001
FALLBACK_MAX_SECONDS = 0.02


@runtime_checkable
class Sender(Protocol):
    """The writing end of a bounded one-way channel."""

    def send(self, obj: Any, timeout: float | None = None) -> None:
        """Hand ``obj`` to the channel; block while it is full. ``timeout`` (seconds;
        None: forever, 0: a try) bounds the wait for room: ``TimeoutError`` then, with
        nothing of the message sent. An error while pickling sends nothing. Raises
        ``ChannelClosed`` after ``close()``/``release()`` here, ``ChannelBroken`` when the
        receiver is gone or closed, or a watched waitable became ready while blocked."""
        ...

    def peer_waiting(self) -> bool:
        """The receiver is blocked waiting for a message right now, as far as this end can
        tell without a system call (False where it cannot tell): a caller holding
        messages back to batch them should send now."""
        ...

    def borrow(self, nbytes: int) -> Any | None:
        """A writable buffer of ``nbytes`` (``len``, the buffer protocol) in the memory a
        message of this channel crosses in, for the caller to build a large buffer in and
        then send it without a copy; None, at once and without waiting, where the
        transport has no such memory or no room now (build it anywhere else then). Only
        the thread that sends may call it; the memory goes back when the buffer is sent
        and read, or dropped unsent (``_lend.py``, Built in place)."""
        ...

    def watch(self, *waitables: Waitable) -> None:
        """While this endpoint blocks, any of these becoming ready means the peer is gone."""
        ...

    def traffic(self) -> Traffic:
        """Messages and bytes through the channel so far, and those still queued."""
        ...

    def close(self) -> None:
        """End the stream: the receiver gets everything sent so far, then ``EndOfStream``.
        Idempotent."""
        ...

    def release(self) -> None:
        """Drop this owner's handle without ending the stream (another owner has it)."""
        ...


@runtime_checkable
class Receiver(Protocol):
    """The reading end of a bounded one-way channel, and its part in ``wait_readable``."""

    def recv(self, timeout: float | None = None) -> Any:
        """The next message. ``timeout`` (seconds, None: forever) bounds the wait for one
        to begin. Raises ``EndOfStream`` after the last message of a closed stream,
        ``ChannelBroken`` when the sender is gone and nothing is buffered (or a watched
        waitable became ready while blocked), ``TimeoutError``, ``ChannelClosed`` after
        ``close()``/``release()`` here, or whatever unpickling raises (the message is
        consumed all the same)."""
        ...

    def skip(self) -> bool:
        """Discard the next message unread: True; False, without blocking, when none is
        buffered. Raises as ``recv`` does at the end of the stream or with a gone sender."""
        ...

    def poll(self) -> bool:
        """``recv`` would return or raise without blocking (a message, the end of the
        stream, or a gone sender). Never consumes a wake-up."""
        ...

    def has_input(self) -> bool:
        """``poll()`` as cheaply as the transport allows: a message or the end of the
        stream; a gone sender need not be looked for (the wait sees it)."""
        ...

    def watch(self, *waitables: Waitable) -> None:
        """While this endpoint blocks, any of these becoming ready means the peer is gone."""
        ...

    def traffic(self) -> Traffic:
        """What this end knows of the channel's traffic (``NO_TRAFFIC`` when it counts none)."""
        ...

    def close(self) -> None:
        """Stop reading: the sender's next ``send`` raises ``ChannelBroken``. Idempotent."""
        ...

    def release(self) -> None:
        """Drop this owner's handle without ending the stream (another owner has it)."""
        ...

    def wait(self, timeout: float | None = None, also: Sequence[Waitable] = ()) -> list[Any]:
        """This receiver alone: block until ``poll()`` or one of ``also`` is ready, at most
        ``timeout`` seconds. Returns the ready ones (this receiver first), [] on timeout."""
        ...

    def arm(self) -> Waitable | None:
        """Step 2 of the module's protocol: from now until ``disarm``, the sender makes the
        returned waitable readable when it publishes a message or ends the stream (a gone
        sender may show as readable too). None: this receiver cannot wake a waiter, which
        then looks at it again on a short interval. A reader that is armed is waiting:
        ``peer_waiting()`` of the sender may say so."""
        ...

    def disarm(self, woken: bool, timed_out: bool = False) -> None:
        """Step 5: the waiter is awake. ``woken``: the waitable ``arm`` gave was readable,
        consume its wake-up now (before the waiter looks again; never anywhere else).
        ``timed_out``: the block ran out its whole ``RECHECK_SECONDS`` with nothing
        readable, so input found now without a wake-up under way was a wake-up lost or
        late (the waker not yet done publishing): the transport counts which."""
        ...


Endpoint = Sender | Receiver

_local = threading.local()


def wait_readable(
    receivers: Iterable[Receiver], timeout: float | None = None, also: Iterable[Waitable] = ()
) -> list[Any]:
    """The receivers (and ``also`` waitables) ready within ``timeout``; [] on timeout. A
    receiver is ready when ``recv`` would not block: a message, the end of the stream, or
    a gone sender. One receiver waits its own way, several by the module's protocol."""
    receivers = list(receivers)
    if len(receivers) == 1:
        return receivers[0].wait(timeout, tuple(also))
    return wait_together(receivers, timeout, also)


def wait_together(
    receivers: Sequence[Receiver], timeout: float | None = None, also: Iterable[Waitable] = ()
) -> list[Any]:
    """``wait_readable`` by the module's protocol, for receivers of any transport."""
    receivers = list(receivers)
    also = list(also)
    deadline = None if timeout is None else time.monotonic() + timeout
    ready = [r for r in receivers if r.has_input()]  # step 1: no arming while input is there
    if ready:
        return ready
    if timeout is None or timeout > 0:
        ready = _spin(receivers)
        if ready:
            return ready
    return asleep(lambda: _wait_armed(receivers, deadline, also))


def _spin(receivers: list[Receiver]) -> list[Receiver]:
    """The receivers that got input within ``SPIN_SECONDS`` of looking, [] if none did.
    Only looks (no arming): as ``Sleeper.wait`` spins for one receiver, and by the same
    rule, kept per thread: after ``SPIN_MISSES`` spins in a row that found nothing, only
    one wait in ``SPIN_PROBE`` spins until one finds input again (the others yield once
    before they arm, as ``Sleeper.wait`` says why). Arming, sleeping and
    being woken cost the waiter and every sender a system call per item; a loop that takes
    batches as they are ready (``in_order=False``) waits here for each one."""
    state = getattr(_local, "spin", None)
    if state is None:
        state = _local.spin = [0, 0]  # waits, misses in a row
    state[0] += 1
    if state[1] >= _wakeup.SPIN_MISSES and state[0] % _wakeup.SPIN_PROBE:
        os.sched_yield()  # no spin, but one yield before arming: see ``Sleeper.wait``
        return []
    end = time.perf_counter() + _wakeup.SPIN_SECONDS
    while True:  # one look at least, however late this thread runs
        os.sched_yield()
        ready = [r for r in receivers if r.has_input()]
        if ready:
            state[1] = 0
            return ready
        if time.perf_counter() >= end:
            state[1] += 1
            return []


def _wait_armed(receivers: list[Receiver], deadline: float | None, also: list[Waitable]) -> list[Any]:
    fallback = FALLBACK_SECONDS
    while True:
        handles: list[Waitable | None] = []
        try:
            for receiver in receivers:
                handles.append(receiver.arm())
            ready = [r for r in receivers if r.has_input()]
            if ready:
                for receiver in receivers:
                    receiver.disarm(False)
                return ready
            blind = any(h is None for h in handles)
            bound = fallback if blind else RECHECK_SECONDS
            left = bound if deadline is None else min(bound, max(0.0, deadline - time.monotonic()))
            if _wakeup.race_hook is not None:
                _wakeup.race_hook("armed")
            armed = [h for h in handles if h is not None]
            hits = poll_waitables([*armed, *also], left)
        except BaseException:
            for receiver in receivers[: len(handles)]:
                receiver.disarm(False)
            raise
        timed_out = not hits and left == RECHECK_SECONDS
        for receiver, handle in zip(receivers, handles):
            receiver.disarm(handle is not None and any(h is handle for h in hits), timed_out)
        ready = [r for r in receivers if r.poll()]
        others = [w for w in also if any(h is w for h in hits)]
        if ready or others:
            return [*ready, *others]
        if deadline is not None and time.monotonic() >= deadline:
            return []
        fallback = min(2 * fallback, FALLBACK_MAX_SECONDS)


def poll_waitables(waitables: Sequence[Waitable], timeout: float) -> list[Any]:
    """The waitables readable, hung up or invalid within ``timeout`` seconds (at once when
    0), each as given.

    What ``multiprocessing.connection.wait`` does, without building a new selector on
    every call: a reader waiting for each item in turn waits on the same descriptors over
    and over. The poll object is kept per thread (one object must not be polled by two
    threads at once) and per set of descriptor numbers, which is all a poll object holds."""
    fds = tuple(w if isinstance(w, int) else w.fileno() for w in waitables)
    pollers = getattr(_local, "pollers", None)
    if pollers is None:
        pollers = _local.pollers = {}
    poller = pollers.get(fds)
    if poller is None:
        if len(pollers) >= 16:
            pollers.clear()
        poller = pollers[fds] = select.poll()
        for fd in set(fds):
            poller.register(fd, select.POLLIN)
    events = poller.poll(math.ceil(timeout * 1000))
    if not events:
        return []
    hit = {fd for fd, _ in events}
    return [w for w, fd in zip(waitables, fds) if fd in hit]


__all__ = [
    "FALLBACK_MAX_SECONDS",
    "FALLBACK_SECONDS",
    "RECHECK_SECONDS",
    "Endpoint",
    "Receiver",
    "Sender",
    "Waitable",
    "poll_waitables",
    "wait_readable",
    "wait_together",
]
