"""Channels over OS pipes: the portable transport, with the same capacity limits as the rings.

    Sender.send(obj) --pickle 5--> [ data pipe ] --> Receiver.recv() -> obj
                     <-- one byte per message read -- [ credit pipe ]

A message is one ``send_bytes`` frame, ``[u64 nbuf][nbuf x u64 length][pickle][buffers]``
(``_frame.py``, shared with the stream transport), pickled as the rings pickle
(``serialize.py``: registered reducers, large buffers out of band, written after the
stream); an empty frame is the end-of-stream marker. The receiver writes one byte to the credit pipe for every message
it has read, so the sender knows how many messages and bytes are still in flight and
waits while ``capacity_items`` messages or ``capacity_bytes`` bytes are (a message larger
than ``capacity_bytes`` goes alone): the same backpressure as the shared-memory rings, not
merely the kernel's pipe buffer. The kernel buffer still bounds what is in the pipe itself.

No wake-up can be lost here: every wait is the kernel's (``poll`` on a pipe that holds the
data or the credits themselves), not a flag beside the data. A blocked endpoint waits on
its pipe *and* on the waitables given to ``watch`` (process sentinels, say), so a dead peer
is noticed at once; a peer whose every handle is closed shows as end-of-file or a broken
pipe.

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
import time
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from . import _frame
from ._memory import PAGE
from ._ring import MIN_RING
from ._wakeup import asleep
from .errors import ChannelBroken, ChannelClosed, EndOfStream
from .serialize import Encoder
from .traffic import NO_TRAFFIC, Lending, Traffic

_END_OF_STREAM = b""

# Credits travel as bytes in a pipe whose kernel buffer holds at least 64 KiB; at most
# ``capacity_items`` credits are ever unread, so a receiver's credit never blocks.
_MAX_ITEMS = 1 << 16

# Every endpoint alive in this process, so that a forked child can drop the handles it
# inherited but does not own (a pipe reports a dead peer only once *every* handle of
# the other end is closed).
_ENDPOINTS: weakref.WeakSet[_Endpoint] = weakref.WeakSet()


class _Endpoint:
    def __init__(self, conn: Connection, credits: Connection) -> None:
        self._conn: Connection | None = conn
        self._credits: Connection | None = credits
        self._watched: tuple[Any, ...] = ()
        _ENDPOINTS.add(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        _ENDPOINTS.add(self)

    def watch(self, *waitables: Any) -> None:
        """While this endpoint blocks, any of these becoming ready means the peer is gone."""
        self._watched = waitables

    def release(self) -> None:
        """Drop this process's handle without ending the stream (it belongs to another process)."""
        conn, self._conn = self._conn, None
        credits, self._credits = self._credits, None
        for handle in (conn, credits):
            if handle is not None:
                handle.close()


class PipeSender(_Endpoint):
    """Writing end. ``send`` blocks while ``capacity_items`` messages or ``capacity_bytes``
    bytes are unread (backpressure); a reader whose every handle is closed breaks it."""

    def __init__(self, conn: Connection, credits: Connection, capacity_items: int, capacity_bytes: int) -> None:
        super().__init__(conn, credits)
        self._capacity_items = min(capacity_items, _MAX_ITEMS)
        self._capacity_bytes = capacity_bytes
        self._in_flight: deque[int] = deque()  # sizes of the messages not yet read
        self._in_flight_bytes = 0
        self._messages = 0
        self._bytes = 0
        self._encoder = Encoder()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_encoder"]  # holds a pickler; the new owner makes its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._encoder = Encoder()

    def send(self, obj: Any, timeout: float | None = None) -> None:
        """Pickle ``obj`` and write it; block while the channel is full.

        ``timeout`` (seconds; None: forever, 0: do not wait) bounds the wait for room
        before the first byte: ``TimeoutError`` then, and nothing was written."""
        conn = self._live()
        encoder = self._encoder
        head, stream, buffers = _frame.encode(encoder, obj)
        try:
            data = b"".join([head, stream, *buffers])
        finally:
            encoder.release()
        deadline = None if timeout is None else time.monotonic() + timeout
        self._wait_for_room(len(data), deadline)
        if deadline is not None and not self._writable(deadline):
            raise TimeoutError("no room in the channel within the timeout; nothing was sent")
        try:
            conn.send_bytes(data)
        except (BrokenPipeError, ConnectionResetError, EOFError) as exc:
            raise ChannelBroken("the receiving end of the channel is gone") from exc
        self._in_flight.append(len(data))
        self._in_flight_bytes += len(data)
        self._messages += 1
        self._bytes += len(data)

    def peer_waiting(self) -> bool:
        """Unknown through a pipe: always False (a batching caller relies on its timer)."""
        return False

    def traffic(self) -> Traffic:
        """Messages and bytes written so far, and those not yet read (as the credits say)."""
        if self._conn is None:
            return NO_TRAFFIC
        try:
            self._take_credits()
        except ChannelBroken:
            pass
        return Traffic(self._messages, self._bytes, len(self._in_flight), self._in_flight_bytes)

    def close(self) -> None:
        """End the stream: the receiver gets everything sent so far, then ``EndOfStream``."""
        conn = self._conn
        if conn is None:
            return
        try:
            conn.send_bytes(_END_OF_STREAM)
        except OSError:
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

    def _wait_for_room(self, size: int, deadline: float | None) -> None:
        self._take_credits()
        credits = self._credits
        assert credits is not None
        while self._full(size):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = asleep(lambda: wait([credits, *self._watched], left))
            if not ready:
                raise TimeoutError("no room in the channel within the timeout; nothing was sent")
            self._take_credits()
            if self._full(size) and not any(r is credits for r in ready):
                raise ChannelBroken("a watched process ended while this sender waited for room in the channel")

    def _take_credits(self) -> None:
        credits = self._credits
        if credits is None:
            raise ChannelClosed("send on a closed channel")
        try:
            read = os.read(credits.fileno(), _MAX_ITEMS)
        except BlockingIOError:
            return
        if not read:
            raise ChannelBroken("the receiver closed the channel, or the receiving process is gone (it exited or was killed)")
        for _ in range(min(len(read), len(self._in_flight))):
            self._in_flight_bytes -= self._in_flight.popleft()

    def _writable(self, deadline: float) -> bool:
        probe = select.poll()
        probe.register(self._live().fileno(), select.POLLOUT)
        return bool(probe.poll(max(0, math.ceil((deadline - time.monotonic()) * 1000))))


class PipeReceiver(_Endpoint):
    """Reading end. ``recv`` blocks until a message, the end of stream, or a dead peer."""

    def __init__(self, conn: Connection, credits: Connection) -> None:
        super().__init__(conn, credits)
        self._ended = False
        self._probe: Any = None  # a poll object on the pipe, made at the first look

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_probe"] = None  # a poll object does not travel; the new owner makes its own
        return state

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

    def traffic(self) -> Traffic:
        """Not counted at this end: the sender's figures are the channel's."""
        return NO_TRAFFIC

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
                raise ChannelBroken("the sending process is gone")
        return _frame.decode(memoryview(self._take()))

    def skip(self) -> bool:
        """Discard the next message without unpickling it; False, without blocking, when
        nothing is buffered (a message that has begun arriving is read through)."""
        conn = self._live()
        if self._ended:
            raise EndOfStream()
        if not conn.poll(0):
            return False
        self._take()
        return True

    def close(self) -> None:
        """Stop reading: the sender's next ``send`` (or its wait for room) breaks."""
        self.release()

    def _take(self) -> bytes:
        """Read one frame and give its credit back; the end-of-stream marker ends here."""
        conn = self._live()
        try:
            data = conn.recv_bytes()
        except (EOFError, ConnectionResetError) as exc:
            raise ChannelBroken("the sending end closed without ending the stream") from exc
        if data == _END_OF_STREAM:
            self._ended = True
            raise EndOfStream()
        credits = self._credits
        if credits is not None:
            try:
                os.write(credits.fileno(), b"\x01")
            except (BrokenPipeError, BlockingIOError):
                pass  # the sender is gone (or ended its stream): nobody counts credits any more
        return data

    def _live(self) -> Connection:
        if self._conn is None:
            raise ChannelClosed("receive on a closed channel")
        return self._conn


def open_pipe_channel(ctx: Any, *, capacity_items: int, capacity_bytes: int) -> tuple[PipeSender, PipeReceiver]:
    """A one-way channel over OS pipes holding at most ``capacity_items`` messages and
    ``capacity_bytes`` bytes of pickles (a larger message goes alone), the bytes rounded up
    exactly as the shared-memory ring's size is, so both transports hold as much."""
    if isinstance(capacity_items, bool) or not isinstance(capacity_items, int) or capacity_items < 1:
        raise ValueError(f"capacity_items must be an int >= 1, got {capacity_items!r}")
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
        raise ValueError(f"capacity_bytes must be an int >= 1, got {capacity_bytes!r}")
    capacity_bytes = max(MIN_RING, -(-capacity_bytes // PAGE) * PAGE)  # rounded as a ring's size is
    reader, writer = ctx.Pipe(duplex=False)
    _grow_kernel_buffer(writer.fileno(), capacity_bytes)
    credits_in, credits_out = ctx.Pipe(duplex=False)
    os.set_blocking(credits_in.fileno(), False)  # the sender only ever takes what is there
    os.set_blocking(credits_out.fileno(), False)
    return PipeSender(writer, credits_in, capacity_items, capacity_bytes), PipeReceiver(reader, credits_out)


def _grow_kernel_buffer(fd: int, capacity_bytes: int) -> None:
    """Make the kernel's pipe buffer hold a full channel (plus framing), where the system
    allows it (Linux: up to ``/proc/sys/fs/pipe-max-size``), so that a send the credits
    allow is not then held up by the kernel. Elsewhere the kernel's buffer may bound first."""
    setsize = getattr(fcntl, "F_SETPIPE_SZ", None) if fcntl is not None else None
    if setsize is None:
        return
    want = capacity_bytes + capacity_bytes // 8 + PAGE
    try:
        fcntl.fcntl(fd, setsize, want)
    except OSError:
        try:
            with open("/proc/sys/fs/pipe-max-size") as limit:
                fcntl.fcntl(fd, setsize, min(want, int(limit.read())))
        except (OSError, ValueError):
            pass


def lending() -> Lending:
    """Pipes copy every buffer: nothing is ever lent."""
    return Lending(0, 0, 0, 0)


def release_all_except(keep: Iterable[Any]) -> None:
    """In a freshly forked child: drop every inherited endpoint that is not in ``keep``."""
    kept = {id(endpoint) for endpoint in keep}
    for endpoint in list(_ENDPOINTS):
        if id(endpoint) not in kept:
            endpoint.release()


