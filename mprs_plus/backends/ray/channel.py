"""Channels over Ray: a third implementation of the declared ``transport.Sender`` and
``transport.Receiver`` protocols (``transport/channel.py``).

    data     sender in actor A: send() appends to A's box --pull(cid, n)--> receiver anywhere
             (worker -> main, dispatch -> worker)          one Ray object per pull: every
                                                            message waiting, up to n
    control  sender in the training process --deliver(cid, seq, msg)--> box in actor B, read
             by the child's listener thread                 numbered, re-ordered in the box

A *box* is one channel's queue inside the actor that hosts one end (``_boxes``, looked up by
channel id; whichever comes first, the endpoint or a call, creates it). The training process
cannot serve calls, so its data ends pull and its control ends push.

Why pulls: the receiver keeps ``PULLS_IN_FLIGHT`` pulls in flight (served in order), and a
pull takes every message waiting, up to its share, so messages travel many to a Ray object
(one Ray call costs the training process far more CPU than a message does: its
submission, and Ray's own thread handling the answer; figures in ``docs/benchmarks.md``).
A pull waits in the sender's actor at most ``PULL_WAIT`` seconds for a first message, then
lingers for more until its oldest one has waited ``HAND_ON`` (the batching's rule): a slow
producer's items then share a call, and none waits longer than the rule allows. An empty
answer makes the receiver ask again.

Bounds: the sender's box holds at most ``capacity_items`` messages (``send`` blocks, with
the same ``timeout`` rule as the shared-memory sender); the pulls in flight together ask for
at most ``capacity_items`` minus what the receiver holds unread. So at most twice the
capacity is in flight per channel.

Messages are pickled when sent, with the transport's encoder (its reducers for tensors and
arrays): an item that cannot be pickled fails its ``send`` in the sender, as locally, never
a pull. Large buffers travel out of band as uint8 arrays, which Ray stores as their own
buffers; the receiver copies them into writable memory, as the shared-memory transport
does when it does not lend.

The receiver never polls Ray: an answer completes the pull's future in Ray's thread, whose
callback makes the receiver's wake-up pipe readable while a waiter has it armed (the wait
protocol of ``transport/channel.py``). Never a wait forever on Ray: every wait is in slices
of at most ``SLICE`` seconds, between which the watched waitables (the children's
sentinels, which the placement fires when an actor is gone) and the deadline are looked
at; a pull of a dead actor fails, and the receiver raises ``ChannelBroken``. Ray's own
exceptions end here: they never pass on.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import ray

from ...runtime.child.batching import HAND_ON  # how long a pull lingers: the batching's rule
from ...transport import ChannelBroken, ChannelClosed, EndOfStream, Traffic
from ...transport.channel import wait_together
from ...transport.serialize import Encoder

PULL_WAIT = 0.25  # seconds a pull waits in the sender's actor for a first message
SLICE = 0.02  # seconds between two looks at watched waitables while waiting on Ray
# A pull answers within PULL_WAIT unless Ray lost it (or its actor cannot get a thread for
# that long): then the channel is broken, never waited on forever.
LOST_PULL = 60.0
# Until its first answer, a channel also waits for its sender's actor to start (a loaded
# node, a runtime_env that installs packages), which the placement bounds at 120 s.
FIRST_ANSWER = 180.0
PULLS_IN_FLIGHT = 2  # per receiver
_RECHECK = 1.0  # seconds between two looks of a control receiver with no deadline at its box


@dataclass(eq=False)
class ChannelSpec:
    """What both ends of one channel know, in the training process: its id and capacity,
    and the actor that hosts the end other processes call (set by the placement when it
    starts that actor)."""

    cid: str
    capacity: int
    control: bool
    host: Any = None  # data: the sender's actor; control: the receiver's actor
    early: list[Any] = field(default_factory=list)  # control messages sent before the host existed


def open_ray_channel(
    *, capacity_items: int, capacity_bytes: int, control: bool = False
) -> tuple[RaySender, RayReceiver]:
    """A one-way channel over Ray holding at most ``capacity_items`` messages in its
    sender's box (``capacity_bytes`` is not enforced: Ray's object store bounds bytes)."""
    del capacity_bytes
    if isinstance(capacity_items, bool) or not isinstance(capacity_items, int) or capacity_items < 1:
        raise ValueError(f"capacity_items must be an int >= 1, got {capacity_items!r}")
    spec = ChannelSpec(uuid.uuid4().hex, capacity_items, control)
    return RaySender(spec), RayReceiver(spec)


# -- boxes: the queues of the channel ends an actor hosts --------------------------------


class _Box:
    def __init__(self) -> None:
        self.cv = threading.Condition(threading.Lock())
        self.queue: deque[Any] = deque()
        self.stamps: deque[float] = deque()  # data: when each message of ``queue`` came
        self.closed = False
        self.pullers = 0  # pulls waiting for messages now (a first one, or more: the linger)
        self.pull_turn = 0  # data: the pull served next (they may arrive out of order)
        self.next_seq = 0  # control: the next message in order
        self.early: dict[int, tuple[Any, bool]] = {}  # control: arrived before their turn
        self.messages = 0
        self.bytes = 0


_boxes: dict[str, _Box] = {}
_boxes_lock = threading.Lock()


def _box(cid: str) -> _Box:
    with _boxes_lock:
        box = _boxes.get(cid)
        if box is None:
            box = _boxes[cid] = _Box()
        return box


def serve_pull(cid: str, limit: int, seq: int) -> tuple[list[Any], bool]:
    """In the sender's actor: up to ``limit`` messages waiting, and whether the stream
    ended after them. Waits ``PULL_WAIT`` at most for a first message, then lingers for
    more until the oldest one has waited ``HAND_ON`` (or ``limit`` are there). Pulls are
    served in the order they were asked for (``seq``), whatever thread of the actor runs
    them first."""
    box = _box(cid)
    with box.cv:
        turn = time.monotonic() + LOST_PULL
        while box.pull_turn != seq and time.monotonic() < turn:
            box.cv.wait(SLICE)  # the previous pull is served now, or about to be
        box.pullers += 1
        try:
            deadline = time.monotonic() + PULL_WAIT
            while not box.queue and not box.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                box.cv.wait(left)
            while box.queue and len(box.queue) < limit and not box.closed:
                left = box.stamps[0] + HAND_ON - time.monotonic()
                if left <= 0:
                    break
                box.cv.wait(left)  # woken by each send (``pullers``) and by the close
        finally:
            box.pullers -= 1
        count = min(limit, len(box.queue))
        taken = [box.queue.popleft() for _ in range(count)]
        for _ in range(count):
            box.stamps.popleft()
        ended = box.closed and not box.queue
        box.pull_turn = seq + 1
        box.cv.notify_all()  # room for a blocked sender, the turn of the next pull
        return taken, ended


def serve_deliver(cid: str, seq: int, message: Any, last: bool) -> None:
    """In the receiver's actor: put control message ``seq`` in order (calls to a threaded
    actor may run out of order)."""
    box = _box(cid)
    with box.cv:
        box.early[seq] = (message, last)
        while box.next_seq in box.early:
            message, last = box.early.pop(box.next_seq)
            box.next_seq += 1
            if last:
                box.closed = True
            else:
                box.queue.append(message)
        box.cv.notify_all()


# -- endpoints -------------------------------------------------------------------------


class RaySender:
    """The sending end. In an actor (data): appends to its box. In the training process
    (control): calls the receiver's actor, at most ``capacity`` calls unanswered."""

    def __init__(self, spec: ChannelSpec) -> None:
        self._spec = spec
        self._box: _Box | None = None  # set where the box lives (an actor's data sender)
        self._open = True
        self._encoder: Encoder | None = None
        self._watched: list[Any] = []
        # Control (training process): calls in flight, the next sequence number.
        self._calls: deque[Any] = deque()
        self._seq = 0
        self._messages = 0

    def __getstate__(self) -> dict[str, Any]:
        if self._spec.control:
            raise TypeError("internal error: a control sender stays in the training process")
        return {"cid": self._spec.cid, "capacity": self._spec.capacity}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(ChannelSpec(state["cid"], state["capacity"], False))  # type: ignore[misc]
        self._box = _box(state["cid"])
        self._encoder = Encoder()

    def send(self, obj: Any, timeout: float | None = None) -> None:
        if not self._open:
            raise ChannelClosed("send on a closed channel: this sender was closed or released")
        if self._box is None:
            self._push(obj, False, timeout)
            return
        packed = _pack(self._encoder, obj)  # an error pickling sends nothing, as locally
        box, capacity = self._box, self._spec.capacity
        deadline = None if timeout is None else time.monotonic() + timeout
        with box.cv:
            while len(box.queue) >= capacity:
                if box.closed:
                    raise ChannelBroken("the channel was closed")
                left = SLICE if deadline is None else min(SLICE, deadline - time.monotonic())
                if left <= 0:
                    raise TimeoutError("no room in the channel")
                box.cv.wait(left)
            box.queue.append(packed)
            box.stamps.append(time.monotonic())
            box.messages += 1
            box.bytes += packed[2]
            if box.pullers:
                box.cv.notify_all()

    def peer_waiting(self) -> bool:
        """The receiver has a pull waiting for data now (for a first message, or lingering
        for more: either way a message sent now leaves with it)."""
        box = self._box
        return box is not None and box.pullers > 0

    def close(self) -> None:
        """End of stream: the receiver gets every message sent, then ``EndOfStream``."""
        if not self._open:
            return
        self._open = False
        if self._box is not None:
            with self._box.cv:
                self._box.closed = True
                self._box.cv.notify_all()
            return
        try:
            self._push(None, True, 0)
        except Exception:
            pass  # the receiver's actor is gone or stuck: it ends with it

    def release(self) -> None:
        """The training process's copy of an end an actor owns: nothing to let go of."""

    def watch(self, *waitables: Any) -> None:
        self._watched.extend(waitables)

    def traffic(self) -> Traffic:
        box = self._box
        if box is None:
            return Traffic(self._messages, 0, 0, 0)
        return Traffic(box.messages, box.bytes, len(box.queue), 0)

    def _push(self, obj: Any, last: bool, timeout: float | None) -> None:
        spec = self._spec
        if spec.host is None:  # the actor is not started yet: the message travels with its setup
            spec.early.append((self._seq, obj, last))
            self._seq += 1
            self._messages += 1
            return
        calls = self._calls
        deadline = None if timeout is None else time.monotonic() + timeout
        while calls:
            done, _ = ray.wait(list(calls), num_returns=len(calls), timeout=0)
            for ref in done:
                calls.remove(ref)
                _checked(ref)
            if len(calls) < spec.capacity:
                break
            left = SLICE if deadline is None else min(SLICE, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError("the child has not taken its control messages")
            ray.wait([calls[0]], timeout=left)
            if _ready(self._watched):
                raise ChannelBroken("the child is gone")
        calls.append(spec.host.deliver.remote(spec.cid, self._seq, obj, last))
        self._seq += 1
        self._messages += 1


def _checked(ref: Any) -> None:
    try:
        ray.get(ref, timeout=0)
    except Exception as exc:
        raise ChannelBroken(f"the actor at the other end is gone ({type(exc).__name__})") from None


class _Pull:
    """One pull in flight: its answer's future (completed by Ray's own thread), how many
    messages it asked for, and when."""

    __slots__ = ("future", "asked", "at")

    def __init__(self, future: Any, asked: int, at: float) -> None:
        self.future = future
        self.asked = asked
        self.at = at


class RayReceiver:
    """The receiving end. A data receiver (anywhere) pulls from the sender's actor; a
    control receiver (in an actor) reads its box.

    A data receiver never polls Ray: each pull's answer completes a future in Ray's own
    thread, whose callback makes this receiver's wake-up pipe readable while a waiter has
    it armed (``arm``/``disarm``, the protocol of ``transport/channel.py``). A look
    (``has_input``) is a look at the oldest future, without a call into Ray."""

    def __init__(self, spec: ChannelSpec) -> None:
        self._spec = spec
        self._box: _Box | None = None  # a control receiver in its actor
        self._buffer: deque[Any] = deque()
        self._pulls: deque[_Pull] = deque()  # oldest (answered next) first
        self._pull_seq = 0
        self._ended = False  # the sender closed and every message is here
        self._broken: str | None = None
        self._answered_at: float | None = None  # the last answer: the sender's actor runs
        self._closed = False
        self._watched: list[Any] = []
        self._messages = 0
        self._bytes = 0
        # The wake-up pipe (made at the first arm), and whether a waiter has it armed; the
        # lock makes an answer's callback and close() agree on whether the pipe is open.
        self._wake_lock = threading.Lock()
        self._wake: tuple[int, int] | None = None
        self._armed = False

    def __getstate__(self) -> dict[str, Any]:
        spec = self._spec
        early = None
        if spec.control:
            early, spec.early = spec.early, []  # they travel with the receiver, once
        return {"cid": spec.cid, "capacity": spec.capacity, "control": spec.control, "host": spec.host, "early": early}

    def __setstate__(self, state: dict[str, Any]) -> None:
        spec = ChannelSpec(state["cid"], state["capacity"], state["control"], state["host"])
        self.__init__(spec)  # type: ignore[misc]
        if spec.control:
            self._box = _box(spec.cid)
            for seq, message, last in state["early"] or ():
                serve_deliver(spec.cid, seq, message, last)

    # The interface ---------------------------------------------------------------------

    def recv(self, timeout: float | None = None) -> Any:
        if self._box is not None:
            return self._recv_box(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._buffer:
                return self._take()
            self._check_end()
            left = SLICE if deadline is None else min(SLICE, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError("no message within the timeout")
            self._absorb(left)
            if not self._buffer and not self._ended and self._broken is None and _ready(self._watched):
                self._broken = "a watched process ended"

    def skip(self) -> bool:
        """Drop the next message unread; False when none is here now (never blocks)."""
        if not self._buffer:
            self._absorb(0)
        if self._buffer:
            self._buffer.popleft()
            self._kick()
            return True
        self._check_end()
        return False

    def has_input(self) -> bool:
        """``recv`` would not block: a message, the end of the stream, or a gone sender."""
        if self._box is not None:
            return bool(self._box.queue) or self._box.closed
        if not self._buffer and not self._ended and self._broken is None:
            self._absorb(0)
        return bool(self._buffer) or self._ended or self._broken is not None or self._closed

    poll = has_input

    def watch(self, *waitables: Any) -> None:
        self._watched.extend(waitables)

    def close(self) -> None:
        self._closed = True
        self._buffer.clear()
        self._pulls.clear()
        with self._wake_lock:
            wake, self._wake = self._wake, None
        for fd in wake or ():
            os.close(fd)

    def release(self) -> None:
        """The training process's copy of an end an actor owns: nothing to let go of."""

    def traffic(self) -> Traffic:
        queued = len(self._buffer)
        return Traffic(self._messages + queued, self._bytes, queued, 0)

    def wait(self, timeout: float | None = None, also: Sequence[Any] = ()) -> list[Any]:
        """This receiver alone, by the protocol every receiver follows."""
        return wait_together([self], timeout, also)

    def arm(self) -> Any:
        """The wake-up pipe's reading end, readable once a pull is answered from now on
        (None for a control receiver, whose waiter looks again on a short interval)."""
        if self._box is not None or self._closed:
            return None
        with self._wake_lock:
            if self._wake is None:
                self._wake = os.pipe()
                for fd in self._wake:
                    os.set_blocking(fd, False)
            self._armed = True
            return self._wake[0]

    def disarm(self, woken: bool, timed_out: bool = False) -> None:
        del timed_out
        with self._wake_lock:
            self._armed = False
            if woken and self._wake is not None:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake[0], 4096)

    # Internals ---------------------------------------------------------------------------

    def _check_end(self) -> None:
        if self._closed:
            raise ChannelClosed("recv on a closed channel")
        if self._broken is not None:
            raise ChannelBroken(self._broken)
        if self._ended:
            raise EndOfStream()

    def _take(self) -> Any:
        stream, buffers, _ = self._buffer.popleft()
        self._kick()
        return pickle.loads(stream, buffers=[bytearray(buffer) for buffer in buffers])

    def _kick(self) -> None:
        """Keep ``PULLS_IN_FLIGHT`` pulls in flight while there is room for their answers:
        each asks for a share of the room, so that what they bring and what is here stays
        within the capacity. Two overlap one pull's round trip with the next one's."""
        if self._ended or self._broken is not None or self._closed:
            return
        capacity = self._spec.capacity
        while len(self._pulls) < PULLS_IN_FLIGHT:
            room = capacity - len(self._buffer) - sum(pull.asked for pull in self._pulls)
            if room <= 0:
                return
            asked = min(room, max(1, -(-capacity // PULLS_IN_FLIGHT)))
            future = self._spec.host.pull.remote(self._spec.cid, asked, self._pull_seq).future()
            self._pull_seq += 1
            self._pulls.append(_Pull(future, asked, time.monotonic()))
            future.add_done_callback(self._answered)

    def _answered(self, _future: Any) -> None:
        """In Ray's thread (or this one, for an answer already there): wake an armed waiter."""
        with self._wake_lock:
            if self._armed and self._wake is not None:
                with contextlib.suppress(BlockingIOError):
                    os.write(self._wake[1], b"\0")

    def _absorb(self, timeout: float) -> None:
        """Take the answers that are here, in order; with none, wait at most ``timeout``
        for the oldest pull's."""
        if not self._pulls:
            self._kick()
            if not self._pulls:
                return
        oldest = self._pulls[0]
        if not oldest.future.done():
            if timeout > 0:
                futures.wait([oldest.future], timeout=timeout)
            if not oldest.future.done():
                lost = self._lost(oldest)
                if lost is not None:
                    self._pulls.clear()
                    self._broken = lost
                return
        while self._pulls and self._pulls[0].future.done() and self._broken is None and not self._ended:
            self._settle(self._pulls.popleft())
        self._kick()

    def _lost(self, pull: _Pull) -> str | None:
        """Why ``pull`` counts as lost, or None while it may still come: unanswered for
        ``LOST_PULL`` since it was asked and since the sender's actor last answered one.
        Before any answer, the actor may still be starting: then ``FIRST_ANSWER``."""
        now, answered = time.monotonic(), self._answered_at
        if answered is None:
            if now - pull.at > FIRST_ANSWER:
                return f"the actor at the other end has not answered its first pull within {FIRST_ANSWER:.0f} s"
        elif now - max(pull.at, answered) > LOST_PULL:
            return f"the actor at the other end has not answered a pull for {LOST_PULL:.0f} s"
        return None

    def _settle(self, pull: _Pull) -> None:
        try:
            taken, ended = pull.future.result(timeout=0)
        except Exception as exc:
            self._broken = f"the actor at the other end is gone ({type(exc).__name__})"
            self._pulls.clear()
            return
        self._answered_at = time.monotonic()
        self._buffer.extend(taken)
        self._messages += len(taken)
        self._bytes += sum(size for _, _, size in taken)
        if ended:
            self._ended = True
            self._pulls.clear()  # asked after the end: nothing more can come

    def _recv_box(self, timeout: float | None) -> Any:
        box = self._box
        assert box is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        with box.cv:
            while not box.queue:
                if box.closed:
                    raise EndOfStream()
                if deadline is None:
                    box.cv.wait(_RECHECK)  # woken by serve_deliver; the slice bounds a lost wake-up
                else:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError("no message within the timeout")
                    box.cv.wait(left)
            self._messages += 1
            return box.queue.popleft()


def _pack(encoder: Encoder | None, obj: Any) -> tuple[bytes, list[Any], int]:
    """``obj`` pickled by the transport's encoder: the stream, its large buffers as uint8
    arrays (copies: the sender's user may reuse its memory once ``send`` returns), and the
    size in bytes."""
    import numpy

    encoder = encoder or Encoder()
    stream, views = encoder.encode(obj)
    try:
        data = bytes(stream)
        buffers = [numpy.frombuffer(view, dtype=numpy.uint8).copy() for view in views]
    finally:
        encoder.release()
    return data, buffers, len(data) + sum(buffer.nbytes for buffer in buffers)


def _ready(waitables: list[Any]) -> bool:
    return bool(waitables) and bool(_poll_fds(waitables, 0))


def _poll_fds(waitables: Iterable[Any], timeout: float) -> list[Any]:
    waitables = list(waitables)
    if not waitables:
        if timeout > 0:
            time.sleep(timeout)  # nothing to wait on but time (the caller's slice)
        return []
    poller = select.poll()
    fds = [w if isinstance(w, int) else w.fileno() for w in waitables]
    for fd in set(fds):
        poller.register(fd, select.POLLIN)
    hit = {fd for fd, _ in poller.poll(int(timeout * 1000))}
    return [w for w, fd in zip(waitables, fds) if fd in hit]
