"""Channels over OS pipes: the simple transport, bounded by the pipe's kernel buffer.

    Sender.send(obj) --pickle 5--> [ kernel pipe buffer ] --> Receiver.recv() -> obj

A message is one ``send_bytes`` frame; an empty frame is the end-of-stream marker
(a pickle is never empty). A blocked ``recv`` waits on the pipe *and* on the waitables
given to ``watch`` (process sentinels, say), so a dead peer is noticed at once instead
of by polling.
"""

from __future__ import annotations

import math
import pickle
import select
import weakref
from collections.abc import Iterable
from multiprocessing.connection import Connection, wait
from typing import Any

from .errors import ChannelBroken, ChannelClosed, EndOfStream
from .traffic import NO_TRAFFIC, Traffic

_END_OF_STREAM = b""

# Every endpoint alive in this process, so that a forked child can drop the handles it
# inherited but does not own (a pipe reports a dead peer only once *every* handle of
# the other end is closed).
_ENDPOINTS: "weakref.WeakSet[_Endpoint]" = weakref.WeakSet()


class _Endpoint:
    _conn: Connection | None

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._watched: tuple[Any, ...] = ()
        _ENDPOINTS.add(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        _ENDPOINTS.add(self)

    def watch(self, *waitables: Any) -> None:
        """While this endpoint blocks, any of these becoming ready means the peer is gone."""
        self._watched = waitables

    def traffic(self) -> Traffic:
        """Not counted by this transport: the kernel pipe does not say."""
        return NO_TRAFFIC

    def release(self) -> None:
        """Drop this process's handle without ending the stream (it belongs to another process)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class PipeSender(_Endpoint):
    """Writing end. ``send`` blocks while the kernel buffer is full (backpressure);
    a reader whose every handle is closed breaks the pipe."""

    def send(self, obj: Any, timeout: float | None = None) -> None:
        """``timeout`` (seconds; None: forever, 0: do not wait) bounds the wait for room in
        the pipe before the first byte: ``TimeoutError`` then, and nothing was written."""
        conn = self._live()
        data = pickle.dumps(obj, protocol=5)
        if timeout is not None:
            probe = select.poll()
            probe.register(conn.fileno(), select.POLLOUT)
            if not probe.poll(max(0, math.ceil(timeout * 1000))):
                raise TimeoutError("no room in the channel within the timeout; nothing was sent")
        try:
            conn.send_bytes(data)
        except (BrokenPipeError, ConnectionResetError, EOFError) as exc:
            raise ChannelBroken("the receiving end of the channel is gone") from exc

    def peer_waiting(self) -> bool:
        """Unknown through a pipe: always False (a batching caller relies on its timer)."""
        return False

    def close(self) -> None:
        """End the stream: the receiver gets everything sent so far, then ``EndOfStream``."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            conn.send_bytes(_END_OF_STREAM)
        except OSError:
            pass  # the reader is gone already; nothing is waiting for the marker
        finally:
            conn.close()

    def _live(self) -> Connection:
        if self._conn is None:
            raise ChannelClosed("send on a closed channel")
        return self._conn


class PipeReceiver(_Endpoint):
    """Reading end. ``recv`` blocks until a message, the end of stream, or a dead peer."""

    def __init__(self, conn: Connection) -> None:
        super().__init__(conn)
        self._ended = False

    def fileno(self) -> int:
        """Readable when ``recv`` would not block; for ``multiprocessing.connection.wait``."""
        return self._live().fileno()

    def poll(self) -> bool:
        """True when ``recv`` would return (or raise) without blocking."""
        return self._ended or self._live().poll(0)

    def recv(self, timeout: float | None = None) -> Any:
        conn = self._live()
        if self._ended:
            raise EndOfStream()
        if not conn.poll(0):
            ready = wait([conn, *self._watched], timeout)
            if not ready:
                raise TimeoutError(f"no message within {timeout} s")
            if conn not in ready and not conn.poll(0):
                raise ChannelBroken("the sending process is gone")
        try:
            data = conn.recv_bytes()
        except (EOFError, ConnectionResetError) as exc:
            raise ChannelBroken("the sending end closed without ending the stream") from exc
        if data == _END_OF_STREAM:
            self._ended = True
            raise EndOfStream()
        return pickle.loads(data)

    def skip(self) -> bool:
        """Discard the next message without unpickling it; False, without blocking, when
        nothing is buffered (a message that has begun arriving is read through)."""
        conn = self._live()
        if self._ended:
            raise EndOfStream()
        if not conn.poll(0):
            return False
        try:
            data = conn.recv_bytes()
        except (EOFError, ConnectionResetError) as exc:
            raise ChannelBroken("the sending end closed without ending the stream") from exc
        if data == _END_OF_STREAM:
            self._ended = True
            raise EndOfStream()
        return True

    def close(self) -> None:
        self.release()

    def _live(self) -> Connection:
        if self._conn is None:
            raise ChannelClosed("receive on a closed channel")
        return self._conn


def open_pipe_channel(ctx: Any, *, capacity_items: int = 0, capacity_bytes: int = 0) -> tuple[PipeSender, PipeReceiver]:
    """One-way channel over an OS pipe. Capacities are advisory: the kernel buffer bounds it."""
    del capacity_items, capacity_bytes
    reader, writer = ctx.Pipe(duplex=False)
    return PipeSender(writer), PipeReceiver(reader)


def release_all_except(keep: Iterable[Any]) -> None:
    """In a freshly forked child: drop every inherited endpoint that is not in ``keep``."""
    kept = {id(endpoint) for endpoint in keep}
    for endpoint in list(_ENDPOINTS):
        if id(endpoint) not in kept:
            endpoint.release()


def wait_readable(receivers: Iterable[Any], timeout: float | None = None, also: Iterable[Any] = ()) -> list[Any]:
    """The receivers (and ``also`` waitables) ready within ``timeout``; [] on timeout."""
    return wait([*receivers, *also], timeout)
