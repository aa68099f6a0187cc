"""The writing end of a shared-memory channel: frames into the ring, with backpressure.

See ``_ring.py`` for the layout and the rules both ends follow.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

from ._lend import LENT_BIT, LendArea, lent_ahead
from ._memory import SharedRegion
from ._ring import (
    HEADER,
    ITEMS_READ,
    ITEMS_WRITTEN,
    LENT_BYTES,
    LENT_READ,
    MESSAGE,
    READ_POS,
    RECEIVER_CLOSED,
    RECYCLE_AT,
    REFILL_HALF,
    RX_SLEEPING,
    SENDER_CLOSED,
    SKIP,
    SKIPPED,
    TX_LATE,
    TX_LOOKED,
    TX_RESCUES,
    TX_SLEEPING,
    TX_WAKE_AT,
    WRITE_POS,
    Endpoint,
    close_fds,
    consumer_lags,
    producer_progress,
)
from ._wakeup import Outcome, fence, signal
from .errors import ChannelBroken, ChannelClosed
from .serialize import Encoder


class ShmSender(Endpoint):
    """Writing end. ``send`` blocks while the ring is full (backpressure)."""

    _sleep_flag = TX_SLEEPING
    _counts = (TX_RESCUES, TX_LATE)
    _peer_lags = staticmethod(consumer_lags)

    def __init__(self, region: SharedRegion, wait_fd: int, signal_fd: int, capacity_items: int) -> None:
        super().__init__(region, wait_fd, signal_fd)
        self._capacity_items = capacity_items
        self._recycle_at = min(self._size // 2, RECYCLE_AT)
        self._encoder = Encoder()
        self._torn = False  # a streamed frame was interrupted half-written
        self._area = LendArea(region.ctl, region.lend, region) if region.lend_size else None

    def _extra_state(self) -> tuple[Any, ...]:
        return (self._capacity_items,)

    def send(self, obj: Any, timeout: float | None = None) -> None:
        """Pickle ``obj`` into the ring; block while ``capacity_items`` messages or the
        ring's bytes are in flight. An error while pickling sends nothing.

        ``timeout`` (seconds; None: forever, 0: do not wait) bounds the wait for room: when
        it passes, ``TimeoutError`` is raised and nothing of the message was written. A
        message larger than the ring is written in pieces once its first piece is; only
        the wait for that first piece is bounded.

        Raises ``ChannelClosed`` after ``close()`` / ``release()`` here, ``ChannelBroken``
        when the receiver is gone or closed, or a watched waitable became ready."""
        self._check_sendable()
        encoder = self._encoder
        stream, buffers = encoder.encode(obj)
        try:
            self._send_parts(stream, buffers, timeout)
        finally:
            encoder.release()

    def send_encoded(self, stream: bytes | memoryview, buffers: list[memoryview], timeout: float | None = None) -> None:
        """``send`` of a message pickled already: its pickle stream and out-of-band buffers,
        as another transport received them (``landing.py`` forwards a stream's frames this
        way, never unpickling them). The same waits, bounds and errors as ``send``."""
        self._check_sendable()
        self._send_parts(stream, buffers, timeout)

    def _check_sendable(self) -> None:
        if not self._open:
            raise ChannelClosed("send on a closed channel: this sender was closed or released")
        if self._ctl[RECEIVER_CLOSED] or self._torn:
            self._refuse()

    def descriptors(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """This end as a process that shares no ancestry with this one rebuilds it without
        pickling (``handover.py``, ``landing.py``): its sizes (ring bytes, lend area bytes,
        capacity_items) and its descriptors (the memfd, the space pipe's read end, the data
        pipe's write end), valid while this end is open here."""
        region = self._region
        assert region.fd is not None
        return (region.data_size, region.lend_size, self._capacity_items), (region.fd, self._wait_fd, self._signal_fd)

    @classmethod
    def from_descriptors(cls, sizes: Sequence[int], fds: Sequence[int]) -> ShmSender:
        """The end that ``descriptors`` described, in the process that received them (its
        own from now on; closed here if the end cannot be made)."""
        data_size, lend_size, capacity_items = sizes
        memfd, space_r, data_w = fds
        try:
            region = SharedRegion(memfd, data_size, lend_size)
        except BaseException:
            close_fds(fds)
            raise
        return cls(region, space_r, data_w, capacity_items)

    def borrow(self, nbytes: int) -> Any | None:
        """A writable buffer of ``nbytes`` in this channel's lend area, for a message this
        sender sends next to carry without a copy (``_lend.py``, Built in place); None at
        once where there is no room. Call it from the thread that sends."""
        if self._area is None or not self._open or self._torn:
            return None
        return self._area.borrow(nbytes)

    def lent_extents(self) -> int:
        """Bytes of the lend area lent or in flight now, after taking back what the
        receiver gave back (for tests and statistics)."""
        if self._area is None or not self._open:
            return 0
        self._area.reap()
        return self._area.in_use()

    def receiver_closed(self) -> bool:
        """The receiver has closed its end (read from shared memory, no system call)."""
        return bool(self._ctl[RECEIVER_CLOSED])

    def _send_parts(self, stream: bytes | memoryview, buffers: list[memoryview], timeout: float | None) -> None:
        ctl = self._ctl
        # The common case inline (small, no out-of-band buffer, room, no wrap);
        # _write_frame handles everything, this included.
        length = len(stream)
        frame = (HEADER + HEADER - 1 + length) & -HEADER
        write = ctl[WRITE_POS]
        offset = write % self._size
        if (
            buffers
            or offset + frame > self._recycle_at
            or self._size - (write - ctl[READ_POS]) < frame
            or ctl[ITEMS_WRITTEN] - ctl[ITEMS_READ] >= self._capacity_items
        ):
            self._write_frame(stream, buffers, None if timeout is None else time.monotonic() + timeout)
            write = ctl[WRITE_POS]
        else:
            words, index = self._words, offset >> 3
            words[index] = MESSAGE
            words[index + 1] = length
            words[index + 2] = frame
            offset += HEADER
            self._data[offset : offset + length] = stream
            write += frame
            ctl[WRITE_POS] = write  # publishes the frame
            ctl[ITEMS_WRITTEN] += 1
        fence()
        if ctl[RX_SLEEPING]:
            ctl[RX_SLEEPING] = 0
            if not signal(self._signal_fd):
                raise ChannelBroken("the receiving process is gone (it exited or was killed)")
        ctl[TX_LOOKED] = write  # an open sender's progress (see _wakeup, The watchdog)

    def peer_waiting(self) -> bool:
        """The receiver is blocked waiting for data right now (read from shared memory, no
        system call): a caller holding messages back to batch them should send now."""
        return self._open and self._ctl[RX_SLEEPING] != 0

    def _refuse(self) -> None:
        if self._torn:
            raise ChannelBroken("an earlier send was interrupted in the middle of a message; the stream is unusable")
        raise ChannelBroken("the receiver closed the channel; nothing more will be read")

    def close(self) -> None:
        """End the stream: the receiver gets everything sent so far, then ``EndOfStream``."""
        if not self._open:
            return
        try:
            if not self._torn:  # a torn frame must read as a broken stream, not a clean end
                self._ctl[SENDER_CLOSED] = 1
                self._wake_receiver(strict=False)
        finally:
            self.release()

    # -- writing -------------------------------------------------------------------------

    def _write_frame(self, stream: bytes | memoryview, buffers: list[memoryview], deadline: float | None) -> None:
        # Large buffers go to the lend area (_lend.py): first wait while too many lent
        # bytes are in flight, then reserve their extents (never waited for), so that the
        # frame's size is known. Reserved extents are given back if nothing is sent.
        places = None
        if buffers and self._area is not None:
            planned = self._area.planned(buffers)
            if planned:
                ctl, ahead = self._ctl, lent_ahead(self._size, planned)

                def lend_room() -> bool:
                    in_flight = ctl[LENT_BYTES] - ctl[LENT_READ]
                    return in_flight == 0 or in_flight + planned <= ahead

                if not lend_room():
                    self._wait_for_room(lend_room, deadline)
                places = self._area.reserve(buffers)
        try:
            self._write_frame_placed(stream, buffers, places, deadline)
        except BaseException:
            if places is not None and not self._torn:
                self._area.unreserve(places)  # type: ignore[union-attr]
            raise

    def _write_frame_placed(
        self,
        stream: bytes | memoryview,
        buffers: list[memoryview],
        places: list[tuple[int, int] | None] | None,
        deadline: float | None,
    ) -> None:
        ctl, size = self._ctl, self._size
        nbuf = len(buffers)
        if places is None:
            lengths = [b.nbytes for b in buffers]
            parts: list[memoryview] = buffers
        else:
            lengths = [b.nbytes if p is None else b.nbytes | LENT_BIT for b, p in zip(buffers, places)]
            parts = [b if p is None else memoryview(struct.pack("<QQ", *p)) for b, p in zip(buffers, places)]
        body = HEADER + 8 * nbuf + len(stream) + sum(p.nbytes for p in parts)
        frame = (body + HEADER - 1) & -HEADER
        if ctl[ITEMS_WRITTEN] - ctl[ITEMS_READ] >= self._capacity_items:
            self._wait_for_items(deadline)
        if frame <= size and size - (ctl[WRITE_POS] - ctl[READ_POS]) < frame:
            self._wait_for_room(lambda: size - (ctl[WRITE_POS] - ctl[READ_POS]) >= frame, deadline)
        # Into the lend area only once the frame has room (a wait that times out sends
        # nothing, and copies nothing).
        lent = self._area.fill(buffers, places) if places is not None else 0  # type: ignore[union-attr]
        if frame > size:
            self._write_streamed(stream, parts, lengths, frame, frame - body, deadline)
            ctl[LENT_BYTES] += lent
            return
        write = ctl[WRITE_POS]
        offset = write % size
        if offset >= self._recycle_at and frame <= offset and write == ctl[READ_POS]:
            self._put_header(offset, SKIP, 0, 0, size - offset)
            ctl[SKIPPED] += size - offset
            write += size - offset
            offset = 0
        self._put_header(offset, MESSAGE, nbuf, len(stream), frame)
        position = write + HEADER
        if nbuf:
            position = self._put(position, struct.pack(f"<{nbuf}Q", *lengths))
        position = self._put(position, stream)
        for part in parts:
            position = self._put(position, part)
        # memcpy may copy large buffers with non-temporal stores, which x86 does not keep
        # in order with later stores: fence them before the store that publishes them.
        fence()
        ctl[WRITE_POS] = write + frame  # publishes the whole frame at once
        ctl[ITEMS_WRITTEN] += 1
        ctl[LENT_BYTES] += lent

    def _write_streamed(
        self,
        stream: bytes | memoryview,
        parts: list[memoryview],
        lengths: list[int],
        frame: int,
        padding: int,
        deadline: float | None,
    ) -> None:
        """A frame larger than the ring: header first, then pieces as room appears."""
        stream = memoryview(stream)  # slices of it must not copy
        ctl, size = self._ctl, self._size
        self._wait_for_room(lambda: size - (ctl[WRITE_POS] - ctl[READ_POS]) >= HEADER, deadline)
        self._torn = True  # from the header on, an interruption leaves half a message
        write = ctl[WRITE_POS]
        self._put_header(write % size, MESSAGE, len(parts), stream.nbytes, frame)
        self._publish(write + HEADER)
        if parts:
            self._stream_out(memoryview(struct.pack(f"<{len(lengths)}Q", *lengths)), len(lengths) * 8)
        self._stream_out(stream, stream.nbytes)
        for part in parts:
            self._stream_out(part, part.nbytes)
        self._stream_out(None, padding)
        ctl[ITEMS_WRITTEN] += 1
        self._torn = False

    def _stream_out(self, source: memoryview | None, length: int) -> None:
        ctl, size = self._ctl, self._size
        # Waiting for a quarter of the ring keeps both sides copying big pieces
        # instead of waking each other for every few bytes.
        piece = max(size // 4, HEADER)
        done = 0
        while done < length:
            want = min(length - done, piece)
            if size - (ctl[WRITE_POS] - ctl[READ_POS]) < want:
                self._wait_for_room(lambda: size - (ctl[WRITE_POS] - ctl[READ_POS]) >= want)
            write = ctl[WRITE_POS]
            step = min(size - (write - ctl[READ_POS]), length - done)
            if source is not None:
                self._put(write, source[done : done + step])
            self._publish(write + step)
            done += step

    def _put_header(self, offset: int, kind: int, nbuf: int, pickle_len: int, frame: int) -> None:
        words, index = self._words, offset >> 3
        words[index] = kind | nbuf << 32
        words[index + 1] = pickle_len
        words[index + 2] = frame

    def _put(self, position: int, source: Any) -> int:
        """Copy ``source`` into the ring at ``position``, wrapping at the end."""
        data, size = self._data, self._size
        length = len(source)
        offset = position % size
        first = size - offset
        if length <= first:
            data[offset : offset + length] = source
        else:
            data[offset:] = source[:first]
            data[: length - first] = source[first:]
        return position + length

    def _publish(self, write: int) -> None:
        fence()  # as in _write_frame: the copied bytes before the position
        self._ctl[WRITE_POS] = write
        self._wake_receiver()

    def _wake_receiver(self, strict: bool = True) -> None:
        ctl = self._ctl
        fence()
        woke = True
        if ctl[RX_SLEEPING]:
            ctl[RX_SLEEPING] = 0
            woke = signal(self._signal_fd)
        ctl[TX_LOOKED] = producer_progress(ctl)
        if not woke and strict:
            raise ChannelBroken("the receiving process is gone (it exited or was killed)")

    def _wait_for_items(self, deadline: float | None) -> None:
        """Wait, the channel holding ``capacity_items`` messages, until one was read, or
        in a channel made with ``refill_at_half`` until at most half are left unread (the
        ring's rules). The receiver wakes this side only once ``items_read`` reaches
        ``tx_wake_at``, a word set before the sleeping flag that it reads after it."""
        ctl = self._ctl
        left = self._capacity_items // 2 if ctl[REFILL_HALF] else self._capacity_items - 1
        wake_at = ctl[ITEMS_WRITTEN] - left
        ctl[TX_WAKE_AT] = wake_at
        try:
            self._wait_for_room(lambda: ctl[ITEMS_READ] >= wake_at, deadline)
        finally:
            ctl[TX_WAKE_AT] = 0

    def _wait_for_room(self, room: Callable[[], bool], deadline: float | None = None) -> None:
        ctl = self._ctl
        outcome = self._sleeper.wait(lambda: room() or ctl[RECEIVER_CLOSED], deadline)
        if ctl[RECEIVER_CLOSED]:
            raise ChannelBroken("the receiver closed the channel while this sender waited for room")
        if outcome == Outcome.READY:
            return
        if outcome == Outcome.TIMEOUT:
            raise TimeoutError("no room in the channel within the timeout; nothing was sent")
        if outcome == Outcome.WATCHED:
            raise ChannelBroken("a watched process ended while this sender waited for room in the channel")
        raise ChannelBroken(
            "the receiving process is gone (it exited or was killed) while this sender waited for room"
        )
