"""Channels between the threads of one process, written from ``channel.py``'s protocols alone.

    InProcessSender.send(obj) --pickle--> deque of frames --> InProcessReceiver.recv() -> obj
                               one Condition: room for the sender, a frame for the receiver

What it is for: running the real runtime (child loop, lanes, batching, mux) in one
process with threads, in tests, and showing that a transport other than the two the
service uses between processes needs nothing but the protocols. The service itself never
opens one.

It keeps the contract of the other transports: at most ``capacity_items`` messages and
``capacity_bytes`` bytes of pickles queued (a larger message goes alone into an empty
channel), messages pickled as the rings pickle them (``serialize.py``: a receiver gets a
copy, and an object that does not pickle sends nothing), and the same errors. Each end
has exactly one handle, so ``release()`` of a sender leaves its receiver with a gone peer
(``ChannelBroken`` once the buffered messages are read), as a dead process would.

It gives no waitable to ``wait_readable`` (``arm()`` returns None), which therefore looks
at it on its bounded fallback interval: the path a transport without descriptors takes.
A blocked ``send``/``recv`` waits on the Condition, and looks at the watched waitables
every ``RECHECK_SECONDS``.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, NoReturn

from .channel import RECHECK_SECONDS, Waitable, poll_waitables, wait_together
from .errors import ChannelBroken, ChannelClosed, EndOfStream
from .serialize import Encoder
from .traffic import Traffic

_OPEN, _CLOSED, _GONE = "open", "closed", "gone"  # an end: open, ended cleanly, dropped


class _Shared:
    """What both ends see, under ``cond``."""

    def __init__(self, capacity_items: int, capacity_bytes: int) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.frames: deque[tuple[bytes, list[bytearray], int]] = deque()
        self.capacity_items = capacity_items
        self.capacity_bytes = capacity_bytes
        self.queued_bytes = 0
        self.messages = 0
        self.bytes = 0
        self.sender = _OPEN
        self.receiver = _OPEN
        self.readers_waiting = 0  # the receiver's reader is blocked or armed

    def traffic(self) -> Traffic:
        with self.cond:
            return Traffic(self.messages, self.bytes, len(self.frames), self.queued_bytes)


def _block(shared: _Shared, deadline: float | None, watched: tuple[Waitable, ...]) -> bool:
    """One turn of a blocked end, lock held: False when ``deadline`` has passed. A watched
    waitable that is ready means the peer is gone."""
    left = RECHECK_SECONDS if deadline is None else min(RECHECK_SECONDS, deadline - time.monotonic())
    if left <= 0:
        return False
    shared.cond.wait(left)
    if watched and poll_waitables(watched, 0):
        raise ChannelBroken("a watched process ended while this endpoint waited")
    return True


class _End:
    def __init__(self, shared: _Shared) -> None:
        self._shared = shared
        self._watched: tuple[Waitable, ...] = ()

    def watch(self, *waitables: Waitable) -> None:
        self._watched = waitables

    def traffic(self) -> Traffic:
        return self._shared.traffic()

    def __reduce__(self) -> NoReturn:
        raise TypeError(
            f"an {type(self).__name__} connects threads of one process and cannot travel to another: "
            "open the channel with mprs_plus.transport.open_channel instead"
        )


class InProcessSender(_End):
    """Writing end. ``send`` blocks while the channel is full (backpressure)."""

    def __init__(self, shared: _Shared) -> None:
        super().__init__(shared)
        self._encoder = Encoder()

    def send(self, obj: Any, timeout: float | None = None) -> None:
        shared = self._shared
        if shared.sender != _OPEN:
            raise ChannelClosed("send on a closed channel: this sender was closed or released")
        encoder = self._encoder
        stream, buffers = encoder.encode(obj)
        try:
            frame = (bytes(stream), [bytearray(b) for b in buffers])
        finally:
            encoder.release()
        size = len(frame[0]) + sum(len(b) for b in frame[1])
        deadline = None if timeout is None else time.monotonic() + timeout
        with shared.cond:
            while True:
                if shared.receiver != _OPEN:
                    raise ChannelBroken("the receiver closed the channel; nothing more will be read")
                frames = shared.frames
                if not frames or (
                    len(frames) < shared.capacity_items and shared.queued_bytes + size <= shared.capacity_bytes
                ):
                    break
                if not _block(shared, deadline, self._watched):
                    raise TimeoutError("no room in the channel within the timeout; nothing was sent")
            frames.append((*frame, size))
            shared.queued_bytes += size
            shared.messages += 1
            shared.bytes += size
            shared.cond.notify_all()

    def peer_waiting(self) -> bool:
        return self._shared.readers_waiting > 0

    def borrow(self, nbytes: int) -> None:
        return None  # messages stay objects between threads: nothing is copied to save

    def close(self) -> None:
        self._let_go(_CLOSED)

    def release(self) -> None:
        """The only handle of this end: the stream has no writer any more (see the module)."""
        self._let_go(_GONE)

    def _let_go(self, state: str) -> None:
        shared = self._shared
        with shared.cond:
            if shared.sender == _OPEN:
                shared.sender = state
                shared.cond.notify_all()


class InProcessReceiver(_End):
    """Reading end. ``recv`` blocks until a message, the end of stream, or a gone peer."""

    def __init__(self, shared: _Shared) -> None:
        super().__init__(shared)
        self._open = True

    def recv(self, timeout: float | None = None) -> Any:
        shared = self._shared
        deadline = None if timeout is None else time.monotonic() + timeout
        with shared.cond:
            self._live()
            if not shared.frames:
                shared.readers_waiting += 1
                try:
                    while not shared.frames and shared.sender == _OPEN:
                        if not _block(shared, deadline, self._watched):
                            raise TimeoutError(f"no message within {timeout} s")
                finally:
                    shared.readers_waiting -= 1
            stream, buffers, _ = self._take()
        return pickle.loads(stream, buffers=buffers)

    def skip(self) -> bool:
        shared = self._shared
        with shared.cond:
            self._live()
            if not shared.frames and shared.sender == _OPEN:
                return False
            self._take()
            return True

    def poll(self) -> bool:
        shared = self._shared
        self._live()
        return bool(shared.frames) or shared.sender != _OPEN

    def has_input(self) -> bool:
        return self.poll()

    def wait(self, timeout: float | None = None, also: Sequence[Waitable] = ()) -> list[Any]:
        return wait_together([self], timeout, also)

    def arm(self) -> None:
        self._live()
        with self._shared.cond:
            self._shared.readers_waiting += 1

    def disarm(self, woken: bool, timed_out: bool = False) -> None:
        with self._shared.cond:
            self._shared.readers_waiting -= 1

    def close(self) -> None:
        """Stop reading: the sender's next ``send`` (or its wait for room) breaks."""
        shared = self._shared
        with shared.cond:
            if self._open:
                self._open = False
                shared.receiver = _CLOSED
                shared.frames.clear()
                shared.queued_bytes = 0
                shared.cond.notify_all()

    def release(self) -> None:
        """The only handle of this end: as ``close()``."""
        self.close()

    def _live(self) -> None:
        if not self._open:
            raise ChannelClosed("receive on a closed channel: this receiver was closed or released")

    def _take(self) -> tuple[bytes, list[bytearray], int]:
        """Lock held: the next frame, or the reason there is none."""
        shared = self._shared
        if shared.frames:
            frame = shared.frames.popleft()
            shared.queued_bytes -= frame[2]
            shared.cond.notify_all()  # room for a blocked sender
            return frame
        if shared.sender == _CLOSED:
            raise EndOfStream()
        raise ChannelBroken("the sender is gone (released without closing the channel) and nothing is buffered")


def open_inprocess_channel(
    ctx: Any = None, *, capacity_items: int, capacity_bytes: int
) -> tuple[InProcessSender, InProcessReceiver]:
    """A one-way channel between threads holding at most ``capacity_items`` messages and
    ``capacity_bytes`` bytes of pickles (a larger message goes alone). ``ctx`` is not used:
    the signature is ``open_channel``'s."""
    del ctx
    if isinstance(capacity_items, bool) or not isinstance(capacity_items, int) or capacity_items < 1:
        raise ValueError(f"capacity_items must be an int >= 1, got {capacity_items!r}")
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
        raise ValueError(f"capacity_bytes must be an int >= 1, got {capacity_bytes!r}")
    shared = _Shared(capacity_items, capacity_bytes)
    return InProcessSender(shared), InProcessReceiver(shared)


__all__ = ["InProcessReceiver", "InProcessSender", "open_inprocess_channel"]
