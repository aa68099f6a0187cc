"""Channels over OS pipes: the portable transport, with the same capacity limits, lending
and figures as the rings.

    Sender.send(obj) --pickle 5--> [ data pipe ] ----------------> Receiver.recv() -> obj
       large buffer --copy--> [ lend area: shared memory ] --view--> (no copy out)
                     <-- credits: a byte per message read,
                         two per extent given back -------- [ credit pipe ]

A message is one frame, ``[u64 nbuf][nbuf x u64 length][pickle][buffers]`` (``_frame.py``,
shared with the stream transport) behind ``multiprocessing.connection``'s length prefix,
pickled as the rings pickle (``serialize.py``: registered reducers, large buffers out of
band, written after the stream); an empty frame is the end-of-stream marker. The receiver
writes one byte to the credit pipe for every message it has read, so the sender knows how
many messages and bytes are still in flight and waits while ``capacity_items`` messages or
``capacity_bytes`` bytes are (a message larger than ``capacity_bytes`` goes alone): the
same backpressure as the shared-memory rings, not merely the kernel's pipe buffer.

Large buffers: the lend area (``_lend.py``, the rings' own machinery)
    Each channel has a region of shared memory (``_memory.py``: a memfd, else an unlinked
    POSIX shared-memory object or file): a control page and a lend area of ``LEND_FACTOR``
    times ``capacity_bytes``. An out-of-band buffer of ``LEND_MIN`` bytes or more is copied
    into a free extent of it, and the frame carries only ``[offset, slot]`` in its place
    (its length word has ``LENT_BIT``), exactly as a ring's frame does; the receiver hands
    the user an array that *is* that memory (``LentViews``), with the same bounds, fork
    safety and page locking as on the rings. The one difference is how an extent travels:

        publish  the sender copies the buffer in, then writes the frame to the data pipe;
                 the receiver reads the frame, then reads the extent
        release  the receiver is done with the extent (the last view died), then writes
                 ``[RELEASE, slot]`` to the credit pipe; the sender reads it, then may
                 write the extent again

    A buffer the sending process built in an extent it borrowed (``borrow``) is published
    the same way without the copy in; its extent is written again only once the RELEASE
    came and the producer's root died (``_lend.py``, Built in place).

    Each hand-over is a ``write`` followed by the peer's ``read`` of the same bytes, which
    the kernel orders with everything each side did before and does after: no argument
    about the processor's memory ordering is needed, so this holds on every machine
    (aarch64, Apple silicon) where the rings' x86 argument does not. Lent bytes in flight
    (sent, not yet read) count against ``capacity_bytes``, from the same credits.

Figures
    The sender and the receiver count messages and bytes in the control page (one writer
    per word), so ``traffic()`` says the same at both ends, as on a ring: a reader that
    waits for one channel sees what the others hold (the stuck-read check of the runtime
    depends on it), and statistics show a pipe's channels. They are statistics: a word
    another process just wrote may be read a moment late, never torn (aligned 64-bit
    words), and nothing else depends on their order.

No wake-up can be lost here: every wait is the kernel's (``poll`` on a pipe that holds the
data or the credits themselves), not a flag beside the data. A blocked endpoint waits on
its pipe *and* on the waitables given to ``watch`` (process sentinels, say), so a dead peer
is noticed at once; a peer whose every handle is closed shows as end-of-file or a broken
pipe. Every such wait is reported as a sleep (``note_blocking``): the sender writes
without blocking and waits for the kernel's buffer in ``poll``, so a sender held up by a
full pipe is seen asleep too, as a ring's sender waiting for room is.

Selected with ``MPRS_PLUS_TRANSPORT=pipe`` (see ``__init__``), and used wherever the
shared-memory transport is not.
"""

from __future__ import annotations

import math
import os

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Windows
    fcntl = None  # type: ignore[assignment]
import select
import struct
import time
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from . import _frame
from ._lend import (
    DESCRIPTOR,
    FREE,
    HOLD_FACTOR,
    LEND_FACTOR,
    LEND_MIN,
    LENT_BIT,
    LENT_COPIED,
    LENT_IN_PLACE,
    SLOT_BASE,
    SLOTS,
    LendArea,
    LentViews,
    lay_out_area,
    lent_ahead,
)
from ._lend import lending as lending
from ._memory import PAGE, SharedRegion
from ._ring import MIN_RING
from ._wakeup import asleep
from .errors import ChannelBroken, ChannelClosed, EndOfStream
from .serialize import Encoder
from .traffic import NO_TRAFFIC, Traffic

_END_OF_STREAM = b""

# The control page's words (64-bit; one writer each): the figures of ``traffic()``.
ITEMS_WRITTEN, BYTES_WRITTEN = 0, 1  # the sender's
ITEMS_READ, BYTES_READ = 8, 9  # the receiver's

# On the credit pipe: a message read is one CREDIT byte, an extent given back the two
# bytes [RELEASE, slot] in one write (atomic: far below PIPE_BUF).
CREDIT, RELEASE = 1, 2
_CREDIT = bytes((CREDIT,))

# At most ``capacity_items`` credits and two bytes per lend slot are ever unread in the
# credit pipe, which must hold them all for a receiver's write never to block: 16 KiB is
# the smallest pipe buffer of the systems this runs on (macOS's at first), less some slack.
_MAX_ITEMS = (16 << 10) - 2 * SLOTS - 512

_DESCRIPTOR = struct.Struct("<QQ")  # [offset, slot] of a lent buffer, in its place in a frame
_LENGTH = struct.Struct("!i")  # multiprocessing.connection's message length prefix
_LONG_LENGTH = struct.Struct("!Q")  # ... after a -1 prefix, for 2 GiB and more

# Every endpoint alive in this process, so that a forked child can drop the handles it
# inherited but does not own (a pipe reports a dead peer only once *every* handle of
# the other end is closed).
_ENDPOINTS: weakref.WeakSet[_Endpoint] = weakref.WeakSet()


class _Endpoint:
    def __init__(self, conn: Connection, credits: Connection, region: SharedRegion) -> None:
        self._conn: Connection | None = conn
        self._credits: Connection | None = credits
        self._watched: tuple[Any, ...] = ()
        self._attach(region)

    def _attach(self, region: SharedRegion) -> None:
        self._region = region.acquire()
        self._ctl = region.ctl
        # Lets go of the region when the endpoint is dropped without release(), once.
        self._finalizer = weakref.finalize(self, region.release)
        _ENDPOINTS.add(self)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for local in ("_ctl", "_finalizer"):
            del state[local]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._attach(self._region)

    def watch(self, *waitables: Any) -> None:
        """While this endpoint blocks, any of these becoming ready means the peer is gone."""
        self._watched = waitables

    def traffic(self) -> Traffic:
        """Messages and bytes written so far, and those not yet read: the same figures at
        both ends (the control page's counters; see the module's docstring)."""
        if self._conn is None:
            return NO_TRAFFIC
        ctl = self._ctl
        written, read = ctl[ITEMS_WRITTEN], ctl[ITEMS_READ]
        sent, taken = ctl[BYTES_WRITTEN], ctl[BYTES_READ]
        return Traffic(
            written, sent, max(0, written - read), max(0, sent - taken), 0, ctl[LENT_IN_PLACE], ctl[LENT_COPIED]
        )

    def release(self) -> None:
        """Drop this process's handle without ending the stream (it belongs to another process)."""
        conn, self._conn = self._conn, None
        credits, self._credits = self._credits, None
        for handle in (conn, credits):
            if handle is not None:
                handle.close()
        if conn is not None:
            self._finalizer()


class PipeSender(_Endpoint):
    """Writing end. ``send`` blocks while ``capacity_items`` messages or ``capacity_bytes``
    bytes are unread (backpressure); a reader whose every handle is closed breaks it."""

    def __init__(
        self, conn: Connection, credits: Connection, region: SharedRegion, capacity_items: int, capacity_bytes: int
    ) -> None:
        self._capacity_items = min(capacity_items, _MAX_ITEMS)
        self._capacity_bytes = capacity_bytes
        # The state of each lend slot as this end knows it (LENT from its reservation until
        # the receiver's RELEASE arrives): where a ring keeps them in its control page.
        self._states = [FREE] * (SLOT_BASE + SLOTS)
        self._in_flight: deque[tuple[int, int]] = deque()  # (pipe bytes, lent bytes) of each unread message
        self._in_flight_bytes = 0
        self._in_flight_lent = 0
        self._release_pending = False  # a RELEASE byte was read, its slot byte not yet
        super().__init__(conn, credits, region)
        self._setup()

    def _setup(self) -> None:
        region = self._region
        self._area = LendArea(self._states, region.lend, region) if region.lend_size else None  # type: ignore[arg-type]
        self._encoder = Encoder()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        del state["_encoder"]  # holds a pickler; the new owner makes its own
        del state["_area"]  # views of this process's mapping; rebuilt from the slots' states
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._setup()

    def send(self, obj: Any, timeout: float | None = None) -> None:
        """Pickle ``obj`` and write it; block while the channel is full.

        ``timeout`` (seconds; None: forever, 0: do not wait) bounds the wait for room
        before the first byte: ``TimeoutError`` then, and nothing was written."""
        self._live()
        encoder = self._encoder
        stream, buffers = encoder.encode(obj)
        try:
            self._send_parts(stream, buffers, timeout)
        finally:
            encoder.release()

    def _send_parts(self, stream: Any, buffers: list[memoryview], timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        area, places = self._area, None
        if buffers and area is not None:
            planned = area.planned(buffers)
            if planned:
                # Lent bytes in flight are bounded as on a ring (``lent_ahead``); a buffer
                # larger than that goes when nothing lent is in flight.
                ahead = lent_ahead(self._capacity_bytes, planned)
                self._wait_until(lambda: not self._in_flight_lent or self._in_flight_lent + planned <= ahead, deadline)
                places = area.reserve(buffers)
        try:
            if places is None:
                lengths = [b.nbytes for b in buffers]
                parts: list[Any] = buffers
                lent = 0
            else:
                lengths = [b.nbytes if p is None else b.nbytes | LENT_BIT for b, p in zip(buffers, places)]
                parts = [b if p is None else _DESCRIPTOR.pack(*p) for b, p in zip(buffers, places)]
                lent = sum(b.nbytes for b, p in zip(buffers, places) if p is not None)
            head = struct.pack(f"<Q{len(lengths)}Q", len(lengths), *lengths)
            size = len(head) + len(stream) + sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
            self._wait_until(lambda: not self._full(size), deadline)
            if deadline is not None and not self._writable(deadline):
                raise TimeoutError("no room in the channel within the timeout; nothing was sent")
            if places is not None:
                area.fill(buffers, places)  # type: ignore[union-attr]  # once the frame has room
            data = b"".join([_prefix(size), head, stream, *parts])
        except BaseException:
            if places is not None:
                area.unreserve(places)  # type: ignore[union-attr]
            raise
        self._write(data)
        self._in_flight.append((size, lent))
        self._in_flight_bytes += size
        self._in_flight_lent += lent
        ctl = self._ctl
        ctl[ITEMS_WRITTEN] += 1
        ctl[BYTES_WRITTEN] += size + lent

    def peer_waiting(self) -> bool:
        """Unknown through a pipe: always False (a batching caller relies on its timer)."""
        return False

    def borrow(self, nbytes: int) -> Any | None:
        """A writable buffer of ``nbytes`` in this channel's lend area, for a message this
        sender sends next to carry without a copy (``_lend.py``, Built in place); None at
        once where there is no room. Call it from the thread that sends."""
        if self._area is None or self._conn is None:
            return None
        try:
            self._take_credits()  # extents the receiver gave back
        except (ChannelBroken, ChannelClosed):
            return None
        return self._area.borrow(nbytes)

    def lent_extents(self) -> int:
        """Bytes of the lend area lent or in flight now (for tests and statistics)."""
        if self._area is None or self._conn is None:
            return 0
        try:
            self._take_credits()
        except ChannelBroken:
            pass
        self._area.reap()
        return self._area.in_use()

    def close(self) -> None:
        """End the stream: the receiver gets everything sent so far, then ``EndOfStream``."""
        if self._conn is None:
            return
        try:
            self._write(_prefix(0))
        except (ChannelBroken, OSError):
            pass  # the reader is gone already; nothing is waiting for the marker
        finally:
            self.release()

    def _live(self) -> Connection:
        if self._conn is None:
            raise ChannelClosed("send on a closed channel")
        return self._conn

    def _full(self, size: int) -> bool:
        if not self._in_flight:
            return False
        return len(self._in_flight) >= self._capacity_items or self._in_flight_bytes + size > self._capacity_bytes

    def _wait_until(self, room: Any, deadline: float | None) -> None:
        """Take credits until ``room()`` holds; a sleep while they do not come."""
        self._take_credits()
        credits = self._credits
        assert credits is not None
        while not room():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = asleep(lambda: wait([credits, *self._watched], left))
            if not ready:
                raise TimeoutError("no room in the channel within the timeout; nothing was sent")
            self._take_credits()
            if not room() and not any(r is credits for r in ready):
                raise ChannelBroken("a watched process ended while this sender waited for room in the channel")

    def _take_credits(self) -> None:
        credits = self._credits
        if credits is None:
            raise ChannelClosed("send on a closed channel")
        try:
            read = os.read(credits.fileno(), 1 << 16)
        except BlockingIOError:
            return
        if not read:
            raise ChannelBroken("the receiver closed the channel, or the receiving process is gone (it exited or was killed)")
        if self._release_pending or RELEASE in read:
            self._take_releases(read)
            return
        self._credit(len(read))

    def _take_releases(self, read: bytes) -> None:
        states, count, at = self._states, 0, 0
        if self._release_pending:
            states[SLOT_BASE + read[0]] = FREE
            at, self._release_pending = 1, False
        while at < len(read):
            if read[at] == RELEASE:
                if at + 1 == len(read):
                    self._release_pending = True  # its slot byte comes with the next read
                    break
                states[SLOT_BASE + read[at + 1]] = FREE
                at += 2
            else:
                count += 1
                at += 1
        self._credit(count)

    def _credit(self, count: int) -> None:
        in_flight = self._in_flight
        for _ in range(min(count, len(in_flight))):
            size, lent = in_flight.popleft()
            self._in_flight_bytes -= size
            self._in_flight_lent -= lent

    def _writable(self, deadline: float) -> bool:
        probe = select.poll()
        probe.register(self._live().fileno(), select.POLLOUT)
        return bool(probe.poll(max(0, math.ceil((deadline - time.monotonic()) * 1000))))

    def _write(self, data: bytes) -> None:
        """Write all of ``data`` to the non-blocking pipe; a full kernel buffer is waited
        for in ``poll``, as a sleep, and a watched waitable ends that wait."""
        fd = self._live().fileno()
        view, done = memoryview(data), 0
        try:
            while done < len(data):
                try:
                    done += os.write(fd, view[done:])
                    continue
                except BlockingIOError:
                    pass
                probe = select.poll()
                probe.register(fd, select.POLLOUT)
                for waitable in self._watched:
                    probe.register(waitable if isinstance(waitable, int) else waitable.fileno(), select.POLLIN)
                events = asleep(lambda: probe.poll())
                if any(event_fd != fd for event_fd, _ in events) and not any(
                    event_fd == fd for event_fd, _ in events
                ):
                    raise ChannelBroken("a watched process ended while this sender waited for room in the channel")
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise ChannelBroken(
                "the receiving process is gone (it exited or was killed), or it closed the channel"
            ) from exc
        finally:
            view.release()


class _Releases:
    """Where the receiver's ``LentViews`` stores a slot's state (a ring's control page has
    a word per slot): storing FREE sends ``[RELEASE, slot]`` to the sender instead. Raises
    ValueError once this end is released, as a released control page would."""

    def __init__(self, credits: Connection) -> None:
        self.fd: int | None = credits.fileno()

    def __setitem__(self, index: int, state: int) -> None:
        fd = self.fd
        if fd is None:
            raise ValueError("the channel was released here")
        try:
            os.write(fd, bytes((RELEASE, index - SLOT_BASE)))
        except OSError:
            pass  # the sender is gone: nobody takes extents back any more


class PipeReceiver(_Endpoint):
    """Reading end. ``recv`` blocks until a message, the end of stream, or a dead peer."""

    def __init__(self, conn: Connection, credits: Connection, region: SharedRegion) -> None:
        self._ended = False
        self._probe: Any = None  # a poll object on the pipe, made at the first look
        super().__init__(conn, credits, region)
        self._setup()

    def _setup(self) -> None:
        region = self._region
        self._releases = _Releases(self._credits) if self._credits is not None else None
        self._lent = (
            LentViews(region, HOLD_FACTOR * max(MIN_RING, region.lend_size // LEND_FACTOR), self._releases)
            if region.lend_size and self._releases is not None
            else None
        )

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_probe"] = None  # a poll object does not travel; the new owner makes its own
        del state["_releases"], state["_lent"]  # this process's views; the new owner makes its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._setup()

    def fileno(self) -> int:
        """Readable when ``recv`` would not block; for ``multiprocessing.connection.wait``."""
        return self._live().fileno()

    def poll(self) -> bool:
        """True when ``recv`` would return (or raise) without blocking."""
        if self._ended:
            return True
        probe = self._probe
        if probe is None:
            probe = self._probe = select.poll()
            probe.register(self._live().fileno(), select.POLLIN)
        else:
            self._live()
        return bool(probe.poll(0))

    def has_input(self) -> bool:
        """``poll()``: through a pipe a message, its end and a gone sender look alike."""
        return self.poll()

    def wait(self, timeout: float | None = None, also: Sequence[Any] = ()) -> list[Any]:
        """This receiver alone: the kernel's wait on its pipe and ``also`` together."""
        return asleep(lambda: wait([self, *also], timeout))

    def arm(self) -> int:
        """The data pipe: readable while a message (or its end) is there, so nothing need
        be set for a sender to wake a waiter."""
        return self.fileno()

    def disarm(self, woken: bool, timed_out: bool = False) -> None:
        """Nothing to undo or drain: the wake-up is the message itself."""

    def recv(self, timeout: float | None = None) -> Any:
        """The next message; ``timeout`` (seconds, None: forever) bounds the wait for it to
        begin. Raises ``EndOfStream``, ``ChannelBroken``, ``TimeoutError``, or whatever
        unpickling raises (the message is consumed all the same)."""
        conn = self._live()
        if self._ended:
            raise EndOfStream()
        if not conn.poll(0):
            ready = asleep(lambda: wait([conn, *self._watched], timeout))
            if not ready:
                raise TimeoutError(f"no message within {timeout} s")
            if conn not in ready and not conn.poll(0):
                raise ChannelBroken("a watched process ended while this receiver waited for a message")
        return self._decode(memoryview(self._take()))

    def skip(self) -> bool:
        """Discard the next message without unpickling it; False, without blocking, when
        nothing is buffered (a message that has begun arriving is read through)."""
        conn = self._live()
        if self._ended:
            raise EndOfStream()
        if not conn.poll(0):
            return False
        data = memoryview(self._take())
        lent = self._lent
        if lent is not None:
            sizes = _frame.lengths(data)
            at = len(data) - sum(DESCRIPTOR if length & LENT_BIT else length for length in sizes)
            for length in sizes:
                if length & LENT_BIT:
                    lent.discard(_DESCRIPTOR.unpack_from(data, at)[1])
                    at += DESCRIPTOR
                else:
                    at += length
        return True

    def close(self) -> None:
        """Stop reading: the sender's next ``send`` (or its wait for room) breaks."""
        self.release()

    def release(self) -> None:
        """Drop this process's handle without ending the stream (it belongs to another
        process). Lent buffers still alive keep their memory; their extents are not
        given back (nobody takes them any more)."""
        releases = getattr(self, "_releases", None)
        if releases is not None:
            releases.fd = None
        super().release()

    def _decode(self, data: memoryview) -> Any:
        """The message of one frame: lent buffers as views of the lend area, the others
        copied into writable memory, as the rings give them."""
        sizes = _frame.lengths(data)
        if not sizes:
            return _frame.loads(data[_frame.COUNT.size :], ())
        in_frame = [DESCRIPTOR if length & LENT_BIT else length for length in sizes]
        at = len(data) - sum(in_frame)
        stream = data[_frame.COUNT.size * (1 + len(sizes)) : at]
        lent_views = self._lent
        buffers: list[Any] = []
        for length, taken in zip(sizes, in_frame):
            if length & LENT_BIT:
                if lent_views is None:
                    raise ChannelBroken("internal error: a lent buffer on a channel without a lend area")
                offset, slot = _DESCRIPTOR.unpack_from(data, at)
                buffers.append(lent_views.take(offset, slot, length & ~LENT_BIT))
            else:
                if length >= LEND_MIN and lent_views is not None:
                    lent_views.count_copied()
                piece = data[at : at + length]
                buffers.append(lent_views.copy_out(piece) if lent_views is not None else bytearray(piece))
            at += taken
        return _frame.loads(stream, buffers)

    def _take(self) -> bytes:
        """Read one frame and give its credit back; the end-of-stream marker ends here."""
        conn = self._live()
        try:
            data = conn.recv_bytes()
        except (EOFError, ConnectionResetError) as exc:
            raise ChannelBroken(
                "the sending process is gone (it exited or was killed without closing the channel) "
                "and nothing is buffered"
            ) from exc
        except OSError as exc:  # end of file after part of a message
            raise ChannelBroken(
                "the sending process is gone (it exited or was killed) in the middle of a message"
            ) from exc
        if data == _END_OF_STREAM:
            self._ended = True
            raise EndOfStream()
        ctl = self._ctl
        ctl[ITEMS_READ] += 1
        ctl[BYTES_READ] += len(data) + _lent_bytes(data)
        credits = self._credits
        if credits is not None:
            try:
                os.write(credits.fileno(), _CREDIT)
            except (BrokenPipeError, BlockingIOError):
                pass  # the sender is gone (or ended its stream): nobody counts credits any more
        return data

    def _live(self) -> Connection:
        if self._conn is None:
            raise ChannelClosed("receive on a closed channel")
        return self._conn


def _lent_bytes(data: bytes) -> int:
    return sum(length & ~LENT_BIT for length in _frame.lengths(data) if length & LENT_BIT)


def _prefix(size: int) -> bytes:
    """``multiprocessing.connection``'s length prefix of a message of ``size`` bytes (its
    ``recv_bytes`` reads what this writes)."""
    if size > 0x7FFFFFFF:
        return _LENGTH.pack(-1) + _LONG_LENGTH.pack(size)
    return _LENGTH.pack(size)


def open_pipe_channel(
    ctx: Any, *, capacity_items: int, capacity_bytes: int, refill_at_half: bool = False
) -> tuple[PipeSender, PipeReceiver]:
    """A one-way channel over OS pipes holding at most ``capacity_items`` messages and
    ``capacity_bytes`` bytes of pickles (a larger message goes alone), the bytes rounded up
    exactly as the shared-memory ring's size is, so both transports hold as much; and a
    lend area of ``LEND_FACTOR`` times that (committed only as it is used).
    ``refill_at_half`` changes nothing here: a sender waits on the kernel for each credit."""
    del refill_at_half
    if isinstance(capacity_items, bool) or not isinstance(capacity_items, int) or capacity_items < 1:
        raise ValueError(f"capacity_items must be an int >= 1, got {capacity_items!r}")
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
        raise ValueError(f"capacity_bytes must be an int >= 1, got {capacity_bytes!r}")
    capacity_bytes = max(MIN_RING, -(-capacity_bytes // PAGE) * PAGE)  # rounded as a ring's size is
    region = SharedRegion.create(0, "mprs_plus channel", lend_size=LEND_FACTOR * capacity_bytes)
    lay_out_area(region)  # in lock chunks only if it will be page-locked
    connections: list[Connection] = []
    try:
        reader, writer = ctx.Pipe(duplex=False)
        connections += [reader, writer]
        credits_in, credits_out = ctx.Pipe(duplex=False)
        connections += [credits_in, credits_out]
        _grow_kernel_buffer(writer.fileno(), capacity_bytes)
        os.set_blocking(writer.fileno(), False)  # full: the sender waits in poll, as a sleep
        os.set_blocking(credits_in.fileno(), False)  # the sender only ever takes what is there
        os.set_blocking(credits_out.fileno(), False)
        ends = PipeSender(writer, credits_in, region, capacity_items, capacity_bytes), PipeReceiver(reader, credits_out, region)
    except BaseException:
        for connection in connections:
            connection.close()
        raise
    finally:
        region.acquire()
        region.release()  # each end holds the region now; with none, this unmaps it
    return ends


def _grow_kernel_buffer(fd: int, capacity_bytes: int) -> None:
    """Make the kernel's pipe buffer hold a full channel's frames (plus framing), where
    the system allows it (Linux: ``F_SETPIPE_SZ``, up to ``/proc/sys/fs/pipe-max-size``),
    so that a send the credits allow is seldom then held up by the kernel. Elsewhere, or
    where neither is there, the kernel's buffer may bound first: the sender then waits for
    it (a sleep, as any wait for room), and nothing else changes."""
    setsize = getattr(fcntl, "F_SETPIPE_SZ", None) if fcntl is not None else None
    if setsize is None:
        return
    want = capacity_bytes + capacity_bytes // 8 + PAGE
    try:
        fcntl.fcntl(fd, setsize, want)
    except OSError:
        try:
            with open(PIPE_MAX_SIZE) as limit:
                fcntl.fcntl(fd, setsize, min(want, int(limit.read())))
        except (OSError, ValueError):
            pass


PIPE_MAX_SIZE = "/proc/sys/fs/pipe-max-size"


def release_all_except(keep: Iterable[Any]) -> None:
    """In a freshly forked child: drop every inherited endpoint that is not in ``keep``."""
    kept = {id(endpoint) for endpoint in keep}
    for endpoint in list(_ENDPOINTS):
        if id(endpoint) not in kept:
            endpoint.release()
