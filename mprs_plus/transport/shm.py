"""Channels over shared memory: a bounded single-producer/single-consumer ring per channel.

The ring and its positions live in one shared region (``_memory.py``); each side spins
briefly and then sleeps on an OS pipe that the other side writes to only when told that
somebody sleeps (``_wakeup.py``). A message is pickled with protocol 5 and its large
buffers are copied straight into the ring (``serialize.py``): one copy in, one copy out.

::

    control page: 64-bit words, one cache line per writer
    +-----------------------------------------------------------------------+
    | line 0  write_pos   items_written  sender_closed      (producer)       |
    | line 1  read_pos    items_read     receiver_closed    (consumer)       |
    | line 2  rx_sleeping  (set by the consumer, cleared by whoever wakes it) |
    | line 3  tx_sleeping  (set by the producer, cleared by whoever wakes it) |
    +-----------------------------------------------------------------------+
    data ring: positions count bytes forever; offset = position % size
    +-----------------------------------------------------------------------+
    |  free  | frame | frame | frame ............ |  free                    |
    +--------^----------------------------------^----------------------------+
          read_pos                           write_pos
    frame: [kind|nbuf  pickle_len  frame_len  0]  32-byte header, never split
           [nbuf x u64 buffer lengths][pickle stream][buffer 0][buffer 1]...[pad to 32]

Rules
    * Backpressure: ``send`` waits while ``capacity_items`` messages or ``capacity_bytes``
      bytes are in flight. A frame up to the ring's size is written whole and published
      with one store of ``write_pos``; a larger one is streamed through the ring in pieces
      while the receiver copies them out.
    * An empty ring whose write offset is past ``recycle_at`` restarts at its beginning
      (a ``SKIP`` frame pads to the end): while the consumer keeps up, the traffic stays in
      the first, warm and prefaulted, pages of the ring instead of sweeping all of it.
    * End of stream: ``sender_closed`` is stored after the last ``write_pos``; the receiver
      reads it first, then ``write_pos``, so it never misses a last message.
    * A dead peer: end-of-file on the wake-up pipe (its every write end belongs to the
      peer), or a watched waitable. Either ends a wait; what is buffered is still delivered.
    * Stores of aligned 64-bit words are atomic and ordered on x86-64 (TSO); the only
      reordering it allows, a store with a later load, is closed by ``fence()``.
"""

from __future__ import annotations

import os
import pickle
import struct
import time
import weakref
from collections.abc import Callable, Iterable
from multiprocessing import connection, reduction
from typing import Any

from ._memory import PAGE, SharedRegion
from ._wakeup import Outcome, Sleeper, fence, signal, wake_pipe
from .errors import ChannelBroken, ChannelClosed, EndOfStream
from .serialize import Encoder

# Control words (indices of 64-bit words in the control page).
_WRITE_POS, _ITEMS_WRITTEN, _SENDER_CLOSED = 0, 1, 2
_READ_POS, _ITEMS_READ, _RECEIVER_CLOSED = 8, 9, 10
_RX_SLEEPING = 16
_TX_SLEEPING = 24

_HEADER = 32  # bytes; frames start on multiples of it, so a header never wraps
_MESSAGE = 0x4D5347  # "MSG": anything else in a header is corruption, i.e. a bug here
_SKIP = 0x534B50  # "SKP"
_LOW32 = 0xFFFFFFFF

_MIN_RING = 16 * PAGE
_RECYCLE_AT = 1 << 20
_PREFAULT = 2 << 20

# Every endpoint alive in this process, so that a forked child can drop the descriptors
# it inherited but does not own (a dead peer shows only once *every* copy is closed).
_ENDPOINTS: weakref.WeakSet[_Endpoint] = weakref.WeakSet()


def open_shm_channel(ctx: Any, *, capacity_items: int, capacity_bytes: int) -> tuple[ShmSender, ShmReceiver]:
    """A one-way channel holding at most ``capacity_items`` messages and ``capacity_bytes``
    bytes (rounded up to whole pages). ``ctx`` is not needed: the endpoints travel to
    children of any start method."""
    del ctx
    if isinstance(capacity_items, bool) or not isinstance(capacity_items, int) or capacity_items < 1:
        raise ValueError(f"capacity_items must be an int >= 1, got {capacity_items!r}")
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
        raise ValueError(f"capacity_bytes must be an int >= 1, got {capacity_bytes!r}")
    size = max(_MIN_RING, -(-capacity_bytes // PAGE) * PAGE)
    fds: list[int] = []
    try:
        data_r, data_w = wake_pipe()  # producer -> consumer: "there is data"
        fds += [data_r, data_w]
        space_r, space_w = wake_pipe()  # consumer -> producer: "there is room"
        fds += [space_r, space_w]
        region = SharedRegion.create(size, "mprs_plus channel", prefault=_PREFAULT)
    except BaseException:
        _close_fds(fds)
        raise
    return ShmSender(region, space_r, data_w, capacity_items), ShmReceiver(region, data_r, space_w)


class _Endpoint:
    """What both ends share: the region, two pipe descriptors, release and pickling."""

    _sleep_flag: int

    def __init__(self, region: SharedRegion, wait_fd: int, signal_fd: int) -> None:
        self._region = region.acquire()
        self._ctl = region.ctl
        self._data = region.data
        self._words = region.words
        self._size = region.data_size
        self._wait_fd = wait_fd  # read end: the peer wakes us through it
        self._signal_fd = signal_fd  # write end: we wake the peer through it
        self._sleeper = Sleeper(region.ctl, self._sleep_flag, wait_fd)
        self._open = True
        # Closes the descriptors when the endpoint is dropped without release(), once.
        self._finalizer = weakref.finalize(self, _let_go, region, (wait_fd, signal_fd))
        _ENDPOINTS.add(self)

    def watch(self, *waitables: Any) -> None:
        """While this endpoint blocks, any of these becoming ready means the peer is gone."""
        self._sleeper.watch(waitables)

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


def _rebuild(cls: type[_Endpoint], state: tuple[Any, ...], extra: tuple[Any, ...]) -> _Endpoint:
    region, wait_dup, signal_dup = state
    return cls(region, wait_dup.detach(), signal_dup.detach(), *extra)  # type: ignore[call-arg]


def _let_go(region: SharedRegion, fds: tuple[int, ...]) -> None:
    _close_fds(fds)
    region.release()


def _close_fds(fds: Iterable[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class ShmSender(_Endpoint):
    """Writing end. ``send`` blocks while the ring is full (backpressure)."""

    _sleep_flag = _TX_SLEEPING

    def __init__(self, region: SharedRegion, wait_fd: int, signal_fd: int, capacity_items: int) -> None:
        super().__init__(region, wait_fd, signal_fd)
        self._capacity_items = capacity_items
        self._recycle_at = min(self._size // 2, _RECYCLE_AT)
        self._encoder = Encoder()
        self._torn = False  # a streamed frame was interrupted half-written

    def _extra_state(self) -> tuple[Any, ...]:
        return (self._capacity_items,)

    def send(self, obj: Any) -> None:
        if not self._open:
            raise ChannelClosed("send on a closed channel: this sender was closed or released")
        ctl = self._ctl
        if ctl[_RECEIVER_CLOSED] or self._torn:
            self._refuse()
        encoder = self._encoder
        stream, buffers = encoder.encode(obj)
        try:
            # The common case inline (small, no out-of-band buffer, room, no wrap);
            # _write_frame handles everything, this included.
            length = len(stream)
            frame = (_HEADER + _HEADER - 1 + length) & -_HEADER
            write = ctl[_WRITE_POS]
            offset = write % self._size
            if (
                buffers
                or offset + frame > self._recycle_at
                or self._size - (write - ctl[_READ_POS]) < frame
                or ctl[_ITEMS_WRITTEN] - ctl[_ITEMS_READ] >= self._capacity_items
            ):
                self._write_frame(stream, buffers)
            else:
                words, index = self._words, offset >> 3
                words[index] = _MESSAGE
                words[index + 1] = length
                words[index + 2] = frame
                offset += _HEADER
                self._data[offset : offset + length] = stream
                ctl[_WRITE_POS] = write + frame  # publishes the frame
                ctl[_ITEMS_WRITTEN] += 1
        finally:
            encoder.release()
        fence()
        if ctl[_RX_SLEEPING]:
            ctl[_RX_SLEEPING] = 0
            if not signal(self._signal_fd):
                raise ChannelBroken("the receiving process is gone (it exited or was killed)")

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
                self._ctl[_SENDER_CLOSED] = 1
                self._wake_receiver(strict=False)
        finally:
            self.release()

    # -- writing -------------------------------------------------------------------------

    def _write_frame(self, stream: memoryview, buffers: list[memoryview]) -> None:
        ctl, size = self._ctl, self._size
        nbuf = len(buffers)
        body = _HEADER + 8 * nbuf + stream.nbytes + sum(b.nbytes for b in buffers)
        frame = (body + _HEADER - 1) & -_HEADER
        if ctl[_ITEMS_WRITTEN] - ctl[_ITEMS_READ] >= self._capacity_items:
            limit = self._capacity_items
            self._wait_for_room(lambda: ctl[_ITEMS_WRITTEN] - ctl[_ITEMS_READ] < limit)
        if frame > size:
            self._write_streamed(stream, buffers, frame, frame - body)
            return
        write = ctl[_WRITE_POS]
        if size - (write - ctl[_READ_POS]) < frame:
            self._wait_for_room(lambda: size - (ctl[_WRITE_POS] - ctl[_READ_POS]) >= frame)
        offset = write % size
        if offset >= self._recycle_at and frame <= offset and write == ctl[_READ_POS]:
            self._put_header(offset, _SKIP, 0, 0, size - offset)
            write += size - offset
            offset = 0
        self._put_header(offset, _MESSAGE, nbuf, stream.nbytes, frame)
        position = write + _HEADER
        if nbuf:
            position = self._put(position, struct.pack(f"<{nbuf}Q", *(b.nbytes for b in buffers)))
        position = self._put(position, stream)
        for buffer in buffers:
            position = self._put(position, buffer)
        ctl[_WRITE_POS] = write + frame  # publishes the whole frame at once
        ctl[_ITEMS_WRITTEN] += 1

    def _write_streamed(self, stream: memoryview, buffers: list[memoryview], frame: int, padding: int) -> None:
        """A frame larger than the ring: header first, then pieces as room appears."""
        ctl, size = self._ctl, self._size
        self._torn = True
        self._wait_for_room(lambda: size - (ctl[_WRITE_POS] - ctl[_READ_POS]) >= _HEADER)
        write = ctl[_WRITE_POS]
        lengths = [b.nbytes for b in buffers]
        self._put_header(write % size, _MESSAGE, len(buffers), stream.nbytes, frame)
        self._publish(write + _HEADER)
        if buffers:
            self._stream_out(memoryview(struct.pack(f"<{len(lengths)}Q", *lengths)), len(lengths) * 8)
        self._stream_out(stream, stream.nbytes)
        for buffer in buffers:
            self._stream_out(buffer, buffer.nbytes)
        self._stream_out(None, padding)
        ctl[_ITEMS_WRITTEN] += 1
        self._torn = False

    def _stream_out(self, source: memoryview | None, length: int) -> None:
        ctl, size = self._ctl, self._size
        # Waiting for a quarter of the ring keeps both sides copying big pieces
        # instead of waking each other for every few bytes.
        piece = max(size // 4, _HEADER)
        done = 0
        while done < length:
            want = min(length - done, piece)
            if size - (ctl[_WRITE_POS] - ctl[_READ_POS]) < want:
                self._wait_for_room(lambda: size - (ctl[_WRITE_POS] - ctl[_READ_POS]) >= want)
            write = ctl[_WRITE_POS]
            step = min(size - (write - ctl[_READ_POS]), length - done)
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
        self._ctl[_WRITE_POS] = write
        self._wake_receiver()

    def _wake_receiver(self, strict: bool = True) -> None:
        ctl = self._ctl
        fence()
        if ctl[_RX_SLEEPING]:
            ctl[_RX_SLEEPING] = 0
            if not signal(self._signal_fd) and strict:
                raise ChannelBroken("the receiving process is gone (it exited or was killed)")

    def _wait_for_room(self, room: Callable[[], bool]) -> None:
        ctl = self._ctl
        outcome = self._sleeper.wait(lambda: room() or ctl[_RECEIVER_CLOSED])
        if ctl[_RECEIVER_CLOSED]:
            raise ChannelBroken("the receiver closed the channel while this sender waited for room")
        if outcome == Outcome.READY:
            return
        if outcome == Outcome.WATCHED:
            raise ChannelBroken("a watched process ended while this sender waited for room in the channel")
        raise ChannelBroken(
            "the receiving process is gone (it exited or was killed) while this sender waited for room"
        )


class ShmReceiver(_Endpoint):
    """Reading end. ``recv`` blocks until a message, the end of stream, or a dead peer."""

    _sleep_flag = _RX_SLEEPING

    def __init__(self, region: SharedRegion, wait_fd: int, signal_fd: int) -> None:
        super().__init__(region, wait_fd, signal_fd)
        self._ended = False

    def fileno(self) -> int:
        """The wake-up pipe. It becomes readable only while this receiver is armed, which
        ``wait_readable`` does: wait through it, not through ``connection.wait`` alone."""
        if not self._open:
            raise ChannelClosed("fileno() of a closed channel")
        return self._wait_fd

    def poll(self) -> bool:
        """True when ``recv`` would return (or raise) without blocking."""
        if not self._open:
            raise ChannelClosed("poll on a closed channel: this receiver was closed or released")
        if self._ended:
            return True
        ctl = self._ctl
        if ctl[_WRITE_POS] != ctl[_READ_POS] or ctl[_SENDER_CLOSED]:
            return True
        return self._sleeper.check_peer_gone()

    def recv(self, timeout: float | None = None) -> Any:
        if not self._open:
            raise ChannelClosed("receive on a closed channel: this receiver was closed or released")
        ctl = self._ctl
        read = ctl[_READ_POS]
        available = ctl[_WRITE_POS] - read
        if available and not self._ended:
            # The common case inline: a whole frame without out-of-band buffers that
            # does not wrap, unpickled in place.
            size, words = self._size, self._words
            offset = read % size
            index = offset >> 3
            frame = words[index + 2]
            if words[index] == _MESSAGE and available >= frame:
                offset += _HEADER
                end = offset + words[index + 1]
                if end <= size:
                    stream = self._data[offset:end]
                    try:
                        return pickle.loads(stream)
                    finally:
                        stream.release()
                        ctl[_READ_POS] = read + frame
                        ctl[_ITEMS_READ] += 1
                        fence()
                        if ctl[_TX_SLEEPING]:
                            ctl[_TX_SLEEPING] = 0
                            signal(self._signal_fd)  # a sender that is gone needs no wake-up
        return self._recv_frame(timeout)

    def _recv_frame(self, timeout: float | None) -> Any:
        if self._ended:
            raise EndOfStream()
        ctl, words, size = self._ctl, self._words, self._size
        while True:
            read = ctl[_READ_POS]
            available = ctl[_WRITE_POS] - read
            if not available:
                self._await_data(read, timeout)
                available = ctl[_WRITE_POS] - read
            index = (read % size) >> 3
            head = words[index]
            frame = words[index + 2]
            kind = head & _LOW32
            if kind == _MESSAGE:
                if available >= frame:
                    return self._take_whole(read, head >> 32, words[index + 1], frame)
                return self._take_streamed(read, head >> 32, words[index + 1])
            if kind != _SKIP:
                raise ChannelBroken(f"internal error: corrupt frame header {head:#x} at position {read}")
            ctl[_READ_POS] = read + frame

    def close(self) -> None:
        """Stop reading: the sender's next ``send`` raises ``ChannelBroken``."""
        if not self._open:
            return
        ctl = self._ctl
        try:
            ctl[_RECEIVER_CLOSED] = 1
            self._wake_sender()
        finally:
            self.release()

    # -- reading -------------------------------------------------------------------------

    def _take_whole(self, read: int, nbuf: int, pickle_len: int, frame: int) -> Any:
        size = self._size
        position = read + _HEADER
        buffers: list[bytearray] = []
        if nbuf:
            lengths = struct.unpack(f"<{nbuf}Q", self._copy(position, 8 * nbuf))
            position += 8 * nbuf
            at = position + pickle_len
            for length in lengths:
                buffers.append(self._copy(at, length))
                at += length
        offset = position % size
        # The stream is unpickled in place when it does not wrap: it needs no copy.
        stream = self._data[offset : offset + pickle_len] if offset + pickle_len <= size else None
        try:
            return pickle.loads(stream if stream is not None else self._copy(position, pickle_len), buffers=buffers)
        finally:
            if stream is not None:
                stream.release()
            self._ctl[_READ_POS] = read + frame
            self._ctl[_ITEMS_READ] += 1
            self._wake_sender()

    def _take_streamed(self, read: int, nbuf: int, pickle_len: int) -> Any:
        """A frame larger than the ring: copy it out piece by piece as it arrives."""
        ctl = self._ctl
        self._advance(read + _HEADER)
        lengths = struct.unpack(f"<{nbuf}Q", self._stream_in(8 * nbuf)) if nbuf else ()
        stream = self._stream_in(pickle_len)
        buffers = [self._stream_in(length) for length in lengths]
        body = _HEADER + 8 * nbuf + pickle_len + sum(lengths)
        self._stream_in(-body % _HEADER, keep=False)
        ctl[_ITEMS_READ] += 1
        self._wake_sender()
        return pickle.loads(stream, buffers=buffers)

    def _stream_in(self, length: int, keep: bool = True) -> bytearray:
        ctl, data, size = self._ctl, self._data, self._size
        out = bytearray(length if keep else 0)
        view = memoryview(out)
        done = 0
        while done < length:
            read = ctl[_READ_POS]
            available = ctl[_WRITE_POS] - read
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
        self._ctl[_READ_POS] = read
        self._wake_sender()

    def _wake_sender(self) -> None:
        ctl = self._ctl
        fence()
        if ctl[_TX_SLEEPING]:
            ctl[_TX_SLEEPING] = 0
            signal(self._signal_fd)  # a sender that is gone needs no wake-up

    def _await_data(self, read: int, timeout: float | None) -> None:
        ctl = self._ctl
        deadline = None if timeout is None else time.monotonic() + timeout
        outcome = self._sleeper.wait(lambda: ctl[_WRITE_POS] != read or ctl[_SENDER_CLOSED], deadline)
        closed = ctl[_SENDER_CLOSED]  # read before write_pos: see the module's rules
        if ctl[_WRITE_POS] != read:
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
        self._sleeper.wait(lambda: ctl[_WRITE_POS] != read or ctl[_SENDER_CLOSED])
        if ctl[_WRITE_POS] != read:
            return
        raise ChannelBroken("the sender stopped in the middle of a message (its process ended); the message is lost")

    def _arm(self) -> None:
        self._ctl[_RX_SLEEPING] = 1

    def _disarm(self) -> None:
        self._ctl[_RX_SLEEPING] = 0


def release_all_except(keep: Iterable[Any]) -> None:
    """In a freshly forked child: drop every inherited endpoint that is not in ``keep``.
    Nothing is sent: the stream of each dropped endpoint goes on in its owner."""
    kept = {id(endpoint) for endpoint in keep}
    for endpoint in list(_ENDPOINTS):
        if id(endpoint) not in kept:
            endpoint.release()


def wait_readable(receivers: Iterable[Any], timeout: float | None = None, also: Iterable[Any] = ()) -> list[Any]:
    """The receivers (and ``also`` waitables) ready within ``timeout``; [] on timeout.

    A receiver is ready when ``recv`` would not block: a message, the end of the stream,
    or a dead sender."""
    receivers = list(receivers)
    also = list(also)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        ready = [r for r in receivers if r.poll()]
        if ready:
            return ready
        for receiver in receivers:
            receiver._arm()  # from now on a sender writes a wake-up byte
        try:
            fence()
            ready = [r for r in receivers if r.poll()]
            if ready:
                return ready
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            hits = connection.wait([*receivers, *also], left)
        finally:
            for receiver in receivers:
                receiver._disarm()
        ready = [r for r in receivers if r.poll()]  # also drains the wake-up bytes
        others = [h for h in hits if not any(h is r for r in receivers)]
        if ready or others:
            return ready + others
        if deadline is not None and time.monotonic() >= deadline:
            return []


__all__ = ["ShmReceiver", "ShmSender", "open_shm_channel", "release_all_except", "wait_readable"]
