"""The reading end of a shared-memory channel: frames out of the ring, in order.

See ``_ring.py`` for the layout and the rules both ends follow.
"""

from __future__ import annotations

import pickle
import struct
import time
from collections.abc import Sequence
from typing import Any

from ._lend import DESCRIPTOR, HOLD_FACTOR, LEND_MIN, LENT_BIT, LentViews
from ._memory import SharedRegion
from ._ring import (
    HEADER,
    ITEMS_READ,
    LENT_READ,
    LOW32,
    MESSAGE,
    READ_POS,
    RECEIVER_CLOSED,
    RX_LATE,
    RX_LOOKED,
    RX_RESCUES,
    RX_SLEEPING,
    SENDER_CLOSED,
    SKIP,
    TX_SLEEPING,
    TX_WAKE_AT,
    WRITE_POS,
    Endpoint,
    consumer_progress,
    producer_lags,
)
from ._wakeup import Outcome, fence, signal
from .errors import ChannelBroken, ChannelClosed, EndOfStream

_DESCRIPTOR = struct.Struct("<QQ")  # [offset, slot] of a lent buffer, where the frame has it


class ShmReceiver(Endpoint):
    """Reading end. ``recv`` blocks until a message, the end of stream, or a dead peer."""

    _sleep_flag = RX_SLEEPING
    _counts = (RX_RESCUES, RX_LATE)
    _peer_lags = staticmethod(producer_lags)

    def __init__(self, region: SharedRegion, wait_fd: int, signal_fd: int) -> None:
        super().__init__(region, wait_fd, signal_fd)
        self._ended = False
        # What a receiver may lend its user at a time (see _lend.py).
        hold_limit = HOLD_FACTOR * region.data_size
        self._lent = LentViews(region, hold_limit) if region.lend_size else None

    def fileno(self) -> int:
        """The wake-up pipe. It becomes readable only while this receiver is armed, which
        ``wait_readable`` does: wait through it, not through ``connection.wait`` alone."""
        if not self._open:
            raise ChannelClosed("fileno() of a closed channel")
        return self._wait_fd

    def poll(self) -> bool:
        """True when ``recv`` would return (or raise) without blocking. Never reads the
        wake-up pipe (see ``_wakeup.py``: only a waiter that just woke may drain it)."""
        if not self._open:
            raise ChannelClosed("poll on a closed channel: this receiver was closed or released")
        if self._ended:
            return True
        ctl = self._ctl
        if ctl[WRITE_POS] != ctl[READ_POS] or ctl[SENDER_CLOSED]:
            return True
        return self._sleeper.check_peer_gone()

    def has_input(self) -> bool:
        """``poll()`` without its system call: a message or the end of the stream, but a
        gone peer is not looked for. Enough before a block, whose ``poll`` reports the
        peer's end as a hang-up of the wake-up pipe anyway."""
        if not self._open:
            raise ChannelClosed("poll on a closed channel: this receiver was closed or released")
        if self._ended:
            return True
        ctl = self._ctl
        return ctl[WRITE_POS] != ctl[READ_POS] or bool(ctl[SENDER_CLOSED])

    def recv(self, timeout: float | None = None) -> Any:
        """The next message. ``timeout`` (seconds, None: forever) bounds the wait for a
        message to begin; one larger than the ring that has begun is read to its end.

        Raises ``EndOfStream`` after the last message of a closed stream, ``ChannelBroken``
        when the sender is gone and nothing is buffered, ``TimeoutError``, or whatever
        unpickling the message raises (the message is consumed all the same)."""
        if not self._open:
            raise ChannelClosed("receive on a closed channel: this receiver was closed or released")
        ctl = self._ctl
        read = ctl[READ_POS]
        available = ctl[WRITE_POS] - read
        if available and not self._ended:
            # The common case inline: a whole frame without out-of-band buffers that
            # does not wrap, unpickled in place.
            size, words = self._size, self._words
            offset = read % size
            index = offset >> 3
            head = words[index]
            frame = words[index + 2]
            if head & LOW32 == MESSAGE and head != MESSAGE and available >= frame:
                return self._take_whole(read, head >> 32, words[index + 1], frame)  # with buffers
            if head == MESSAGE and available >= frame:
                offset += HEADER
                end = offset + words[index + 1]
                if end <= size:
                    stream = self._data[offset:end]
                    try:
                        return pickle.loads(stream)
                    finally:
                        stream.release()
                        read += frame
                        ctl[READ_POS] = read
                        items = ctl[ITEMS_READ] + 1
                        ctl[ITEMS_READ] = items
                        fence()
                        if ctl[TX_SLEEPING] and items >= ctl[TX_WAKE_AT]:
                            ctl[TX_SLEEPING] = 0
                            signal(self._signal_fd)  # a sender that is gone needs no wake-up
                        ctl[RX_LOOKED] = read + items  # an open receiver's progress
        return self._recv_frame(timeout)

    def skip(self) -> bool:
        """Discard the next whole message without unpickling it; False, without blocking,
        when none is buffered. A message larger than the ring that has begun arriving is
        read through to its end.

        Raises ``EndOfStream`` / ``ChannelBroken`` as ``recv`` would when the stream ended /
        the sender is gone and nothing is buffered."""
        if not self._open:
            raise ChannelClosed("skip on a closed channel: this receiver was closed or released")
        if self._ended:
            raise EndOfStream()
        ctl, words, size = self._ctl, self._words, self._size
        while True:
            closed = ctl[SENDER_CLOSED]  # read before write_pos: see the module's rules
            read = ctl[READ_POS]
            available = ctl[WRITE_POS] - read
            if not available:
                if closed:
                    self._ended = True
                    raise EndOfStream()
                if self._sleeper.check_peer_gone() and ctl[WRITE_POS] == read:
                    raise ChannelBroken(
                        "the sending process is gone (it exited or was killed without closing the channel) "
                        "and nothing is buffered"
                    )
                return False
            index = (read % size) >> 3
            head = words[index]
            frame = words[index + 2]
            kind = head & LOW32
            if kind == SKIP:
                ctl[READ_POS] = read + frame
                continue
            if kind != MESSAGE:
                raise ChannelBroken(f"internal error: corrupt frame header {head:#x} at position {read}")
            nbuf, pickle_len = head >> 32, words[index + 1]
            if available >= frame:
                if nbuf:
                    lengths = struct.unpack(f"<{nbuf}Q", self._copy(read + HEADER, 8 * nbuf))
                    self._discard_lent(lengths, read + HEADER + 8 * nbuf + pickle_len)
                    ctl[LENT_READ] += _lent_bytes(lengths)
                ctl[READ_POS] = read + frame
                ctl[ITEMS_READ] += 1
                self._wake_sender()
                return True
            # Only a frame larger than the ring is ever published in part: read it through.
            self._advance(read + HEADER)
            lengths = struct.unpack(f"<{nbuf}Q", self._stream_in(8 * nbuf)) if nbuf else ()
            self._stream_in(pickle_len, keep=False)
            body = HEADER + 8 * nbuf + pickle_len
            for length in lengths:
                if length & LENT_BIT:
                    self._discard_one(self._stream_in(DESCRIPTOR))
                    body += DESCRIPTOR
                else:
                    self._stream_in(length, keep=False)
                    body += length
            self._stream_in(-body % HEADER, keep=False)
            ctl[LENT_READ] += _lent_bytes(lengths)
            ctl[ITEMS_READ] += 1
            self._wake_sender()
            return True

    def _recv_frame(self, timeout: float | None) -> Any:
        if self._ended:
            raise EndOfStream()
        ctl, words, size = self._ctl, self._words, self._size
        while True:
            read = ctl[READ_POS]
            available = ctl[WRITE_POS] - read
            if not available:
                self._await_data(read, timeout)
                available = ctl[WRITE_POS] - read
            index = (read % size) >> 3
            head = words[index]
            frame = words[index + 2]
            kind = head & LOW32
            if kind == MESSAGE:
                if available >= frame:
                    return self._take_whole(read, head >> 32, words[index + 1], frame)
                return self._take_streamed(read, head >> 32, words[index + 1])
            if kind != SKIP:
                raise ChannelBroken(f"internal error: corrupt frame header {head:#x} at position {read}")
            ctl[READ_POS] = read + frame

    def close(self) -> None:
        """Stop reading: the sender's next ``send`` raises ``ChannelBroken``."""
        if not self._open:
            return
        ctl = self._ctl
        try:
            ctl[RECEIVER_CLOSED] = 1
            self._wake_sender(always=True)
        finally:
            self.release()

    # -- reading -------------------------------------------------------------------------

    def _take_whole(self, read: int, nbuf: int, pickle_len: int, frame: int) -> Any:
        size, data = self._size, self._data
        position = read + HEADER
        buffers: list[Any] = []
        lent = 0
        if nbuf:
            offset = position % size  # a multiple of 8
            if offset + 8 * nbuf <= size:
                first = offset >> 3
                lengths = self._words[first : first + nbuf].tolist()  # the table does not wrap
            else:
                lengths = struct.unpack(f"<{nbuf}Q", self._copy(position, 8 * nbuf))
            position += 8 * nbuf
            at = position + pickle_len
            for length in lengths:
                if length & LENT_BIT:
                    length &= ~LENT_BIT
                    lent += length
                    where = at % size
                    if where + DESCRIPTOR <= size:
                        extent, slot = _DESCRIPTOR.unpack_from(data, where)
                    else:
                        extent, slot = _DESCRIPTOR.unpack(self._copy(at, DESCRIPTOR))
                    buffers.append(self._take_lent(extent, slot, length))
                    at += DESCRIPTOR
                else:
                    self._note_copied(length)
                    buffers.append(self._copy_buffer(at, length))
                    at += length
        offset = position % size
        # The stream is unpickled in place when it does not wrap: it needs no copy.
        stream = data[offset : offset + pickle_len] if offset + pickle_len <= size else None
        try:
            return pickle.loads(stream if stream is not None else self._copy(position, pickle_len), buffers=buffers)
        finally:
            if stream is not None:
                stream.release()
            ctl = self._ctl
            if lent:
                ctl[LENT_READ] += lent
            ctl[READ_POS] = read + frame
            ctl[ITEMS_READ] += 1
            self._wake_sender()

    def _take_streamed(self, read: int, nbuf: int, pickle_len: int) -> Any:
        """A frame larger than the ring: copy it out piece by piece as it arrives."""
        ctl = self._ctl
        self._advance(read + HEADER)
        lengths = struct.unpack(f"<{nbuf}Q", self._stream_in(8 * nbuf)) if nbuf else ()
        stream = self._stream_in(pickle_len)
        buffers: list[Any] = []
        body = HEADER + 8 * nbuf + pickle_len
        for length in lengths:
            if length & LENT_BIT:
                extent, slot = struct.unpack("<QQ", self._stream_in(DESCRIPTOR))
                buffers.append(self._take_lent(extent, slot, length & ~LENT_BIT))
                body += DESCRIPTOR
            else:
                self._note_copied(length)
                buffers.append(self._stream_in(length))
                body += length
        self._stream_in(-body % HEADER, keep=False)
        ctl[LENT_READ] += _lent_bytes(lengths)
        ctl[ITEMS_READ] += 1
        self._wake_sender()
        return pickle.loads(stream, buffers=buffers)

    def _take_lent(self, extent: int, slot: int, length: int) -> Any:
        if self._lent is None:
            raise ChannelBroken("internal error: a lent buffer on a channel without a lend area")
        return self._lent.take(extent, slot, length)

    def _note_copied(self, length: int) -> None:
        """A buffer large enough to lend came through the ring: the sender had no room."""
        if length >= LEND_MIN and self._lent is not None:
            self._lent.count_copied()

    def _discard_lent(self, lengths: tuple[int, ...], position: int) -> None:
        """Give back the extents of a whole frame's lent buffers, starting at ``position``."""
        for length in lengths:
            if length & LENT_BIT:
                self._discard_one(self._copy(position, DESCRIPTOR))
                position += DESCRIPTOR
            else:
                position += length

    def _discard_one(self, descriptor: bytearray) -> None:
        if self._lent is not None:
            self._lent.discard(struct.unpack("<QQ", descriptor)[1])

    def _stream_in(self, length: int, keep: bool = True) -> bytearray:
        ctl, data, size = self._ctl, self._data, self._size
        out = bytearray(length if keep else 0)
        view = memoryview(out)
        done = 0
        while done < length:
            read = ctl[READ_POS]
            available = ctl[WRITE_POS] - read
            if not available:
                self._await_rest(read)
                continue
            step = min(available, length - done)
            if keep:
                offset = read % size
                first = min(step, size - offset)
                view[done : done + first] = data[offset : offset + first]
                view[done + first : done + step] = data[: step - first]
            self._advance(read + step)
            done += step
        view.release()
        return out

    def _copy_buffer(self, position: int, length: int) -> Any:
        """An out-of-band buffer copied out of the ring: into page-locked memory where this
        receiver lends page-locked memory (``_lend.py``), else as ``_copy``."""
        lent = self._lent
        if lent is None or lent.locker is None:
            return self._copy(position, length)
        data, size = self._data, self._size
        offset = position % size
        if offset + length <= size:
            return lent.copy_out(data[offset : offset + length])
        return lent.copy_out(memoryview(self._copy(position, length)))  # wraps: rare, two copies

    def _copy(self, position: int, length: int) -> bytearray:
        """``length`` bytes from the ring as a new writable buffer (one copy)."""
        data, size = self._data, self._size
        offset = position % size
        if offset + length <= size:
            return bytearray(data[offset : offset + length])
        out = bytearray(length)
        first = size - offset
        out[:first] = data[offset:]
        out[first:] = data[: length - first]
        return out

    def _advance(self, read: int) -> None:
        self._ctl[READ_POS] = read
        self._wake_sender()

    def _wake_sender(self, always: bool = False) -> None:
        """Wake a sleeping sender: ``always`` (this end closes), or once it may send
        (``items_read`` reached the ``tx_wake_at`` it set; see the ring's rules)."""
        ctl = self._ctl
        fence()
        if ctl[TX_SLEEPING] and (always or ctl[ITEMS_READ] >= ctl[TX_WAKE_AT]):
            ctl[TX_SLEEPING] = 0
            signal(self._signal_fd)  # a sender that is gone needs no wake-up
        ctl[RX_LOOKED] = consumer_progress(ctl)

    def _await_data(self, read: int, timeout: float | None) -> None:
        ctl = self._ctl
        deadline = None if timeout is None else time.monotonic() + timeout
        outcome = self._sleeper.wait(lambda: ctl[WRITE_POS] != read or ctl[SENDER_CLOSED], deadline)
        closed = ctl[SENDER_CLOSED]  # read before write_pos: see the module's rules
        if ctl[WRITE_POS] != read:
            return
        if closed:
            self._ended = True
            raise EndOfStream()
        if outcome == Outcome.TIMEOUT:
            raise TimeoutError(f"no message within {timeout} s")
        if outcome == Outcome.WATCHED:
            raise ChannelBroken("a watched process ended while this receiver waited, and nothing is buffered")
        raise ChannelBroken(
            "the sending process is gone (it exited or was killed without closing the channel) "
            "and nothing is buffered"
        )

    def _await_rest(self, read: int) -> None:
        ctl = self._ctl
        self._sleeper.wait(lambda: ctl[WRITE_POS] != read or ctl[SENDER_CLOSED])
        if ctl[WRITE_POS] != read:
            return
        raise ChannelBroken("the sender stopped in the middle of a message (its process ended); the message is lost")

    # -- waiting: alone (its own Sleeper), or with others (channel.wait_together) -------

    def wait(self, timeout: float | None = None, also: Sequence[Any] = ()) -> list[Any]:
        """This receiver alone: its own ``Sleeper``, which spins while spinning pays and
        keeps its poll object (an in-order reader waits for one worker at a time, and the
        general protocol of ``channel.py`` would cost it a few microseconds more a wait)."""
        if self.has_input():
            return [self]
        deadline = None if timeout is None else time.monotonic() + timeout
        also = tuple(also)
        outcome = self._sleeper.wait(self.has_input, deadline, also)
        if outcome == Outcome.READY or outcome == Outcome.PEER_GONE:
            return [self]
        if outcome == Outcome.WATCHED:
            hits = self._sleeper.hits
            if not hits or self.has_input():
                return [self, *hits]  # with no hit: one of its own watched processes ended
            return hits
        return []

    def arm(self) -> int:
        """Set this side's sleeping flag and fence: a sender that publishes from now on
        writes a byte to the wake-up pipe returned (see ``_wakeup.py``)."""
        if not self._open:
            raise ChannelClosed("wait on a closed channel: this receiver was closed or released")
        self._ctl[RX_SLEEPING] = 1
        fence()
        return self._wait_fd

    def disarm(self, woken: bool, timed_out: bool = False) -> None:
        """Clear the flag; drain the pipe when it woke us. Input found after a whole
        watchdog interval with the flag still set (no sender had begun to wake us) is
        counted in the channel's traffic: late, when the sender had not yet looked at the
        flag after publishing, a rescue otherwise (``_wakeup.py``, The watchdog)."""
        ctl = self._ctl
        lagging = timed_out and self._open and self._peer_lags(ctl)  # before the flag: see _wakeup
        unwoken = ctl[RX_SLEEPING]
        ctl[RX_SLEEPING] = 0
        if woken:
            self._sleeper.drain()
        elif timed_out and unwoken and self._open and self.has_input():
            self._sleeper.count_watchdog_wake(late=lagging)


def _lent_bytes(lengths: tuple[int, ...]) -> int:
    return sum(length & ~LENT_BIT for length in lengths if length & LENT_BIT)
