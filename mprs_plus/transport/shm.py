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

All go through ``Sleeper.wait`` except a wait for several receivers, which runs the same
steps over all of them (``channel.wait_together``, through ``arm`` / ``disarm``).
``poll()``, ``has_input()``, ``skip()`` and ``traffic()`` never block and never read a
wake-up pipe. Control channels are channels like any other.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ._lend import LEND_FACTOR, lay_out_area
from ._memory import PAGE, SharedRegion
from ._receiver import ShmReceiver
from ._ring import ENDPOINTS, MIN_RING, REFILL_HALF, close_fds
from ._sender import ShmSender
from ._wakeup import wake_pipe


def open_shm_channel(
    ctx: Any, *, capacity_items: int, capacity_bytes: int, refill_at_half: bool = False
) -> tuple[ShmSender, ShmReceiver]:
    """A one-way channel holding at most ``capacity_items`` messages and ``capacity_bytes``
    bytes (rounded up to whole pages) in its ring, plus large buffers lent through its lend
    area (``LEND_FACTOR`` times the ring, committed only as it is used; see ``_lend.py``).
    ``refill_at_half``: a full sender waits until half its messages were read, not one
    (safe only where the reader waits for nothing this sender's next message feeds; the
    ring's rules). ``ctx`` is not needed: the endpoints travel to children of any start
    method."""
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
        lay_out_area(region)  # in lock chunks only if it will be page-locked
        region.ctl[REFILL_HALF] = int(refill_at_half)
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


__all__ = ["ShmReceiver", "ShmSender", "open_shm_channel", "release_all_except"]
