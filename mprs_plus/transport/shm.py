"""Channels over shared memory: open one, and the module functions of the interface.

    open_shm_channel(...) -> (ShmSender, ShmReceiver)     _sender.py / _receiver.py
                             one SharedRegion per channel  _memory.py, layout in _ring.py
                             wake-ups through two pipes    _wakeup.py
                             pickling, out-of-band buffers serialize.py

Every blocking wait of this transport, and what ends it (the protocol that makes a lost
wake-up impossible, and the watchdog behind it, are in ``_wakeup.py``):

    wait                              flag / pipe           ended by
    send: room for items or bytes     tx_sleeping / space   receiver's read (byte), receiver
                                                            closed, peer gone (EOF), watched
                                                            waitable, timeout, watchdog
    send: next piece of a big frame   tx_sleeping / space   same, without a timeout
    recv: a message                   rx_sleeping / data    sender's publish (byte), end of
                                                            stream, peer gone, watched, timeout,
                                                            watchdog
    recv: rest of a big frame         rx_sleeping / data    same, without a timeout
    wait_readable: any of n receivers rx_sleeping of each   as recv, for each; the ``also``
                                                            waitables (process sentinels: the
                                                            kernel's, no flag involved)

All go through ``Sleeper.wait`` except ``wait_readable``, which runs the same steps over
several receivers. ``poll()``, ``skip()`` and ``traffic()`` never block and never read a
wake-up pipe. Control channels are channels like any other.
"""

from __future__ import annotations

import math
import select
import threading
import time
from collections.abc import Iterable
from typing import Any

from ._lend import LEND_FACTOR
from ._memory import PAGE, SharedRegion
from ._receiver import ShmReceiver
from ._ring import ENDPOINTS, MIN_RING, close_fds
from ._sender import ShmSender
from . import _wakeup
from ._wakeup import WATCHDOG_SECONDS, Outcome, fence, wake_pipe


def open_shm_channel(ctx: Any, *, capacity_items: int, capacity_bytes: int) -> tuple[ShmSender, ShmReceiver]:
    """A one-way channel holding at most ``capacity_items`` messages and ``capacity_bytes``
    bytes (rounded up to whole pages) in its ring, plus large buffers lent through its lend
    area (``LEND_FACTOR`` times the ring, committed only as it is used; see ``_lend.py``).
    ``ctx`` is not needed: the endpoints travel to children of any start method."""
    del ctx
    if isinstance(capacity_items, bool) or not isinstance(capacity_items, int) or capacity_items < 1:
        raise ValueError(f"capacity_items must be an int >= 1, got {capacity_items!r}")
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
        raise ValueError(f"capacity_bytes must be an int >= 1, got {capacity_bytes!r}")
    size = max(MIN_RING, -(-capacity_bytes // PAGE) * PAGE)
    fds: list[int] = []
    try:
        data_r, data_w = wake_pipe()  # producer -> consumer: "there is data"
        fds += [data_r, data_w]
        space_r, space_w = wake_pipe()  # consumer -> producer: "there is room"
        fds += [space_r, space_w]
        region = SharedRegion.create(size, "mprs_plus channel", lend_size=LEND_FACTOR * size)
    except BaseException:
        close_fds(fds)
        raise
    return ShmSender(region, space_r, data_w, capacity_items), ShmReceiver(region, data_r, space_w)


def release_all_except(keep: Iterable[Any]) -> None:
    """In a freshly forked child: drop every inherited endpoint that is not in ``keep``.
    Nothing is sent: the stream of each dropped endpoint goes on in its owner."""
    kept = {id(endpoint) for endpoint in keep}
    for endpoint in list(ENDPOINTS):
        if id(endpoint) not in kept:
            endpoint.release()


def wait_readable(receivers: Iterable[Any], timeout: float | None = None, also: Iterable[Any] = ()) -> list[Any]:
    """The receivers (and ``also`` waitables) ready within ``timeout``; [] on timeout.

    A receiver is ready when ``recv`` would not block: a message, the end of the stream,
    or a dead sender. Follows the protocol of ``_wakeup.py`` over several receivers at
    once: arm all, fence, check all, block (never longer than the watchdog interval),
    disarm, drain the pipes that woke us, check again."""
    receivers = list(receivers)
    also = list(also)
    deadline = None if timeout is None else time.monotonic() + timeout
    if len(receivers) == 1:
        return _wait_one(receivers[0], deadline, tuple(also))
    return _wakeup.asleep(lambda: _wait_several(receivers, deadline, also))


def _wait_several(receivers: list[Any], deadline: float | None, also: list[Any]) -> list[Any]:
    """``wait_readable`` of several receivers: the protocol's loop over all of them."""
    while True:
        # The looks before the block skip poll()'s check for a gone peer (a system call):
        # the block sees a gone peer as a hang-up of its pipe, and the look after it is
        # poll()'s own.
        ready = [r for r in receivers if r._has_input()]
        if ready:
            return ready
        for receiver in receivers:
            receiver._arm()  # from now on a sender writes a wake-up byte
        unwoken = []
        try:
            fence()
            ready = [r for r in receivers if r._has_input()]
            if ready:
                return ready
            left = WATCHDOG_SECONDS
            if deadline is not None:
                left = min(left, max(0.0, deadline - time.monotonic()))
            if _wakeup.race_hook is not None:
                _wakeup.race_hook("armed")
            hits = _poll([*receivers, *also], left)
        finally:
            unwoken = [receiver._disarm() for receiver in receivers]
        for receiver in receivers:
            if any(h is receiver for h in hits):
                receiver._drain()  # woken: drain before the re-check, never after it
        ready = [r for r in receivers if r.poll()]
        others = [h for h in hits if not any(h is r for r in receivers)]
        if not hits and left == WATCHDOG_SECONDS:
            for receiver, still_set in zip(receivers, unwoken):
                if still_set and receiver in ready:
                    receiver._count_rescue()  # data was there, and no wake-up came
        if ready or others:
            return ready + others
        if deadline is not None and time.monotonic() >= deadline:
            return []


def _wait_one(receiver: Any, deadline: float | None, also: tuple[Any, ...]) -> list[Any]:
    """``wait_readable`` of a single receiver: its own ``Sleeper``, which spins while
    spinning pays and keeps its poll object. An in-order reader waits for one worker at a
    time (``runtime/mux.py``), and the general loop (``_wait_several``) costs it several
    microseconds more per wait (about 5 us per 4 MiB item with two workers, spinning
    disabled in both)."""
    if receiver._has_input():
        return [receiver]
    outcome = receiver._sleeper.wait(receiver._has_input, deadline, also)
    if outcome == Outcome.READY or outcome == Outcome.PEER_GONE:
        return [receiver]
    if outcome == Outcome.WATCHED:
        hits = receiver._sleeper.hits
        if not hits or receiver._has_input():
            return [receiver, *hits]  # with no hit: one of its own watched processes ended
        return hits
    return []


_local = threading.local()


def _poll(waitables: list[Any], timeout: float) -> list[Any]:
    """The waitables (descriptors, or objects with ``fileno()``) readable, hung up or
    invalid within ``timeout`` seconds.

    What ``multiprocessing.connection.wait`` does, without building a new selector on
    every call: a reader waiting for each item in turn waits on the same descriptors
    over and over, and building a selector each time cost it CPU on every wait. The poll object
    is kept per thread (one object must not be polled by two threads at once) and per
    set of descriptor numbers, which is all a poll object holds."""
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


__all__ = ["ShmReceiver", "ShmSender", "open_shm_channel", "release_all_except", "wait_readable"]
