"""The ring of a shared-memory channel: its layout, its rules, and what both ends share.

Each channel is a bounded single-producer/single-consumer ring. The ring and its
positions live in one shared region (``_memory.py``); each side spins briefly and then
sleeps on an OS pipe that the other side writes to only when told that somebody sleeps
(``_wakeup.py``). A message is pickled with protocol 5 and its out-of-band buffers
are copied straight into the ring (``serialize.py``): one copy in, one copy out; a
large one goes to the lend area instead and reaches the receiver as a view of it, with
no copy out (``_lend.py``).

::

    control page: 64-bit words, one cache line per writer
    +-----------------------------------------------------------------------+
    | line 0  write_pos   items_written  sender_closed  lent_bytes  skipped  |
    |         tx_looked  (producer; skipped: bytes of SKIP padding, not      |
    |         traffic; tx_looked: its progress, write_pos + sender_closed,   |
    |         as of its last look at rx_sleeping)                           |
    | line 1  read_pos    items_read     receiver_closed  lent_read          |
    |         rx_looked  (consumer; rx_looked: its progress, read_pos +     |
    |         items_read + receiver_closed, as of its last look at          |
    |         tx_sleeping)                                                  |
    | line 2  rx_sleeping  (set by the consumer, cleared by whoever wakes it) |
    |         rx_rescues   (consumer: wake-ups the watchdog had to stand in  |
    |         for although the producer had looked: a bug)                  |
    |         rx_late      (consumer: the same while the producer had not   |
    |         looked yet: it was kept off the CPU in between, see _wakeup)  |
    | line 3  tx_sleeping  (set by the producer, cleared by whoever wakes it) |
    |         tx_rescues   (producer: the same)                              |
    |         tx_wake_at   (producer, set before tx_sleeping: wake it only   |
    |         once items_read reaches this; 0: at any progress)             |
    |         refill_half  (set once as the channel is made: a full sender  |
    |         waits until half is read, see Backpressure)                   |
    |         tx_late      (producer: as rx_late)                            |
    | line 4  lent_in_place  lent_copied  (producer: large buffers sent      |
    |         from where they were built, and copied in; _lend.py)          |
    | line 5  lock_chunked (set once as the channel is made: its lend area   |
    |         is cut into page-lock chunks; _lend.py)                        |
    | words 64..319: the state of each lend slot (rules in _lend.py)         |
    +-----------------------------------------------------------------------+
    data ring: positions count bytes forever; offset = position % size
    +-----------------------------------------------------------------------+
    |  free  | frame | frame | frame ............ |  free                    |
    +--------^----------------------------------^----------------------------+
          read_pos                           write_pos
    frame: [kind|nbuf  pickle_len  frame_len  0]  32-byte header, never split
           [nbuf x u64 buffer lengths][pickle stream][buffer 0][buffer 1]...[pad to 32]
           a lent buffer: its length word has LENT_BIT set, and in place of its bytes
           the frame holds [u64 offset in the lend area, u64 slot]

Rules
    * Backpressure: ``send`` waits while ``capacity_items`` messages or ``capacity_bytes``
      bytes are in flight, lent bytes (``lent_bytes - lent_read``) counted separately
      against the same size (``_lend.py``). A sender that found ``capacity_items``
      messages in flight goes on once one was read; in a channel made with
      ``refill_at_half``, once half of them were (``tx_wake_at``): woken for every
      message read, a sender ahead of a reader that takes its messages in turn with
      others' costs both sides a wake-up per message. Only where nothing the reader
      waits for depends on this sender's next message (the sender feeds no other
      process, and shares no source with another sender) is that safe: a reader that
      read one message and then waits for another process fed through this sender would
      wait for good. A frame up to the
      ring's size is written whole and published with one store of ``write_pos``; a larger one is streamed through the ring in pieces
      while the receiver copies them out.
    * An empty ring whose write offset is past ``recycle_at`` restarts at its beginning
      (a ``SKIP`` frame pads to the end): while the consumer keeps up, the traffic stays in
      the first, warm pages of the ring instead of sweeping all of it, and only those are
      ever committed (``_memory.py``).
    * End of stream: ``sender_closed`` is stored after the last ``write_pos``; the receiver
      reads it first, then ``write_pos``, so it never misses a last message.
    * A dead peer: end-of-file on the wake-up pipe (its every write end belongs to the
      peer), or a watched waitable. Either ends a wait; what is buffered is still delivered.
    * Stores of aligned 64-bit words are atomic and ordered on x86-64 (TSO); the only
      reordering it allows, a store with a later load, is closed by ``fence()``, and so
      are the non-temporal stores memcpy may use for large buffers.
    * An endpoint is used by one thread at a time; each has one owner process.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable
from multiprocessing import reduction
from typing import Any

from ._lend import LENT_COPIED, LENT_IN_PLACE  # the sender's lend figures: line 4
from ._memory import PAGE, SharedRegion
from ._wakeup import Sleeper
from .errors import ChannelClosed
from .traffic import NO_TRAFFIC, Traffic

# Control words (indices of 64-bit words in the control page).
WRITE_POS, ITEMS_WRITTEN, SENDER_CLOSED, LENT_BYTES, SKIPPED, TX_LOOKED = 0, 1, 2, 3, 4, 5
READ_POS, ITEMS_READ, RECEIVER_CLOSED, LENT_READ, RX_LOOKED = 8, 9, 10, 11, 12
RX_SLEEPING, RX_RESCUES, RX_LATE = 16, 17, 18
TX_SLEEPING, TX_RESCUES, TX_WAKE_AT, REFILL_HALF, TX_LATE = 24, 25, 26, 27, 28

HEADER = 32  # bytes; frames start on multiples of it, so a header never wraps
MESSAGE = 0x4D5347  # "MSG": anything else in a header is corruption, i.e. a bug here
SKIP = 0x534B50  # "SKP"
LOW32 = 0xFFFFFFFF

MIN_RING = 16 * PAGE
RECYCLE_AT = 1 << 20
PREFAULT = 0

# Every endpoint alive in this process, so that a forked child can drop the descriptors
# it inherited but does not own (a dead peer shows only once *every* copy is closed).
ENDPOINTS: weakref.WeakSet[Endpoint] = weakref.WeakSet()


class Endpoint:
    """What both ends share: the region, two pipe descriptors, release and pickling."""

    _sleep_flag: int
    _counts: tuple[int, int]  # where this side counts its watchdog's wake-ups: (rescues, late)
    # peer_lags(ctl): the peer has progress it has not yet looked at this side's flag for
    # (a plain function: a bound method kept by the Sleeper would make a reference cycle).
    _peer_lags: Callable[[Any], bool]

    def __init__(self, region: SharedRegion, wait_fd: int, signal_fd: int) -> None:
        self._region = region.acquire()
        self._ctl = region.ctl
        self._data = region.data
        self._words = region.words
        self._size = region.data_size
        self._wait_fd = wait_fd  # read end: the peer wakes us through it
        self._signal_fd = signal_fd  # write end: we wake the peer through it
        self._sleeper = Sleeper(region.ctl, self._sleep_flag, wait_fd, self._counts, self._peer_lags)
        self._open = True
        # Closes the descriptors when the endpoint is dropped without release(), once.
        self._finalizer = weakref.finalize(self, _let_go, region, (wait_fd, signal_fd))
        ENDPOINTS.add(self)

    def watch(self, *waitables: Any) -> None:
        """While this endpoint blocks, any of these becoming ready means the peer is gone."""
        self._sleeper.watch(waitables)

    def traffic(self) -> Traffic:
        """Messages and bytes through this channel so far, and those still queued in it.
        Read from the shared positions, so both ends see the same figures."""
        if not self._open:
            return NO_TRAFFIC
        ctl = self._ctl
        written, write_pos = ctl[ITEMS_WRITTEN], ctl[WRITE_POS]
        queued = write_pos - ctl[READ_POS]
        sent = write_pos - ctl[SKIPPED] + ctl[LENT_BYTES]
        rescues = ctl[RX_RESCUES] + ctl[TX_RESCUES]
        late = ctl[RX_LATE] + ctl[TX_LATE]
        return Traffic(
            written, sent, written - ctl[ITEMS_READ], queued, rescues, ctl[LENT_IN_PLACE], ctl[LENT_COPIED], late
        )

    def release(self) -> None:
        """Drop this process's handle without ending the stream (it belongs to another process)."""
        if self._open:
            self._open = False
            self._finalizer()

    def __reduce__(self) -> tuple[Any, ...]:
        if not self._open:
            raise ChannelClosed(f"cannot hand a closed {type(self).__name__} to another process")
        state = (self._region, reduction.DupFd(self._wait_fd), reduction.DupFd(self._signal_fd))
        return _rebuild, (type(self), state, self._extra_state())

    def _extra_state(self) -> tuple[Any, ...]:
        return ()


def producer_progress(ctl: Any) -> int:
    """What the consumer may wait for: the write position, and the end of the stream."""
    return ctl[WRITE_POS] + ctl[SENDER_CLOSED]


def consumer_progress(ctl: Any) -> int:
    """What the producer may wait for: room in bytes or in messages, and a closed
    receiver. Lent bytes are read with the frame that carries them, so they move
    ``read_pos`` or ``items_read`` too."""
    return ctl[READ_POS] + ctl[ITEMS_READ] + ctl[RECEIVER_CLOSED]


def producer_lags(ctl: Any) -> bool:
    """The producer published progress it has not yet looked at the consumer's flag for
    (``_wakeup.py``, The watchdog). Reads its looked-at word first."""
    return ctl[TX_LOOKED] < producer_progress(ctl)


def consumer_lags(ctl: Any) -> bool:
    """The same of the consumer, about the producer's flag."""
    return ctl[RX_LOOKED] < consumer_progress(ctl)


def _rebuild(cls: type[Endpoint], state: tuple[Any, ...], extra: tuple[Any, ...]) -> Endpoint:
    region, wait_dup, signal_dup = state
    return cls(region, wait_dup.detach(), signal_dup.detach(), *extra)  # type: ignore[call-arg]


def _let_go(region: SharedRegion, fds: tuple[int, ...]) -> None:
    close_fds(fds)
    region.release()


def close_fds(fds: Iterable[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


