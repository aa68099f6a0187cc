"""The channels of the Ray backend: items over streams, control over Ray calls. Both
implement the declared ``transport.Sender`` and ``transport.Receiver`` protocols
(``transport/channel.py``), so the child loop, the mux and the reader do not change.

    data     sender (worker actor, dispatch actor) ==== one TCP connection ====> receiver
             (worker -> training process, dispatch -> worker)   transport/stream.py
             or, both ends on one node: a shared-memory ring    transport/handover.py
    control  sender in the training process --deliver(cid, seq, msg)--> box in the child's
             actor, read by the child's listener thread    numbered, re-ordered in the box

Data. Ray places the actors and watches them; it does not carry items: a Ray call costs
the training process far more CPU than an item does (figures in ``docs/benchmarks.md``).
Each data channel is one connection of the stream transport, with its frames, credits and
capacities. The first of its two ends to be placed in an actor listens there, on the
node's address as Ray reports it (``listen_here``, the actor's ``listen`` call); the
other end connects to the address that call answers (``ActorAddress``), at its first use,
in a later actor or in the training process, which therefore never listens. Every
connection proves the service's secret (made per service, handed to the actors inside
their channel specs through Ray) before anything on it is unpickled.

Same node. A listening sender also listens on a Unix-domain socket, and the answer names
its node; a receiver whose process runs on that node (by node id, never by address: the
nodes of one machine share it) makes a shared-memory channel instead, and hands its
sending end over that socket (``NearReceiver``, ``NearSender``). The sender takes
whichever peer comes first, both proved. The runtime sees a ``Sender`` and a ``Receiver``
either way; a peer that dies is end-of-file on the ring's wake-up pipe.

Control stays on Ray calls: a handful of messages per epoch (a reset, pause, resume, a
limit, the stop), whose cost (about a millisecond of the training process's CPU per
call) is nothing beside an epoch's items, and which reach a child whose data channels may
not be connected yet (its first epoch travels before it starts). A box is one control
channel's queue in the actor that hosts its receiver (``_boxes``, by channel id; whichever
comes first, the endpoint or a delivery, creates it). The sender keeps at most
``capacity`` calls unanswered; a failed call (the actor is gone) breaks the channel, and
Ray's own exceptions end here: they never pass on.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from ...transport import ChannelBroken, ChannelClosed, EndOfStream, Traffic
from ...transport.channel import RECHECK_SECONDS, poll_waitables, wait_together
from ...transport.stream import (
    StreamReceiver,
    StreamSender,
    StreamSpec,
    _drop_listener,
    _registered,
    _StreamEndpoint,
    listen,
)
from .calls import get_without_cycle

SLICE = 0.02  # seconds between two looks at watched waitables while waiting on Ray
_RECHECK = 1.0  # seconds between two looks of a control receiver with no deadline at its box


# -- data channels: streams, found through Ray ------------------------------------------


def open_stream_channel(secret: bytes, *, capacity_items: int, capacity_bytes: int) -> tuple[NearSender, NearReceiver]:
    """A data channel over one TCP connection (``transport/stream.py``), proved by
    ``secret``, or over shared memory when both ends turn out to share a node; which end
    listens is decided when its ends are placed (``placement.py``)."""
    spec = StreamSpec(secret, capacity_items, capacity_bytes)
    return NearSender(spec), NearReceiver(spec)


# Where an actor answers: (host, port) on the node's address, the node's id, and the
# name of a Unix-domain socket where a sending end may be handed a shared-memory channel
# instead (None where the listening end is not a sender).
Answer = tuple[str, int, str, "str | None"]


def listen_here(
    specs: Sequence[StreamSpec], senders: Sequence[bool] = (), interface: str | None = None
) -> list[Answer]:
    """In an actor: listen for these channels on this node's address (as Ray reports
    it, or the address of the network ``interface`` named: one interface, never all of
    them); for the ends that are senders, also on a Unix-domain socket of this host, for
    a peer on this node (``NearSender``). ``ValueError`` for an interface this node lacks."""
    from ...transport.handover import listen_for_sender

    host = ray.util.get_node_ip_address() if interface is None else interface_address(interface)
    answers: list[Answer] = []
    for spec, sender in zip(specs, list(senders) or [False] * len(specs)):
        # The Unix side first: a sending end that sees its TCP listener sees it too.
        name = listen_for_sender(_near_spec(spec)) if sender else None
        address = listen(dataclasses.replace(spec, host=host))
        assert not isinstance(address, str)
        answers.append((address[0], address[1], this_node(), name))
    return answers


def interface_address(name: str) -> str:
    """The IPv4 address of this host's network interface ``name`` (``psutil`` reads the
    system's table); ``ValueError`` saying which interfaces there are when it has none."""
    import socket

    import psutil

    interfaces = psutil.net_if_addrs()
    for address in interfaces.get(name, ()):
        if address.family == socket.AF_INET:
            return str(address.address)
    known = ", ".join(sorted(n for n, addrs in interfaces.items() if any(a.family == socket.AF_INET for a in addrs)))
    raise ValueError(
        f"RayBackend(listen_interface={name!r}): the node {ray.util.get_node_ip_address()} has no network interface "
        f"{name!r} with an IPv4 address (its interfaces: {known}). Name one that every node has, or None for the "
        "address Ray uses for the node."
    )


# What to do when a landing process could not start or was killed.
_LANDING_ADVICE = (
    " (look at this host's memory, or at what stopped that process; RayBackend(landing=False) reads "
    "the streams in the training process instead)"
)


class ListenFailed(ChannelBroken):
    """The actor at the other end could not listen where it was told to (a setting of the
    service, not a fault of the actor): the reason is the user's to read at once."""


def this_node() -> str:
    """This process's Ray node id."""
    global _node
    if _node is None:
        _node = ray.get_runtime_context().get_node_id()
    return _node


_node: str | None = None


def _near_spec(spec: StreamSpec) -> StreamSpec:
    """The Unix-domain socket's: its own key (one listener per key), the same secret."""
    return dataclasses.replace(spec, key=spec.key + "-near")


class ActorAddress:
    """Where a channel end that listens in an actor can be reached: the answer of the
    actor's ``listen`` call, looked at when the other end first needs it, within the
    wait the stream's endpoint allows (never a wait forever on Ray). A gone actor breaks
    the channel; Ray's exception ends here."""

    def __init__(self, answer: Any, index: int) -> None:
        self._answer = answer
        self._index = index

    def __call__(self, timeout: float) -> tuple[str, int] | None:
        found = self.answer(timeout)
        return None if found is None else (found[0], found[1])

    def answer(self, timeout: float) -> Answer | None:
        """The whole answer (with the node and the Unix-domain name); None while unknown."""
        try:
            ready, _ = ray.wait([self._answer], timeout=timeout)
            if not ready:
                return None
            return tuple(get_without_cycle(self._answer, timeout=0)[self._index])  # type: ignore[return-value]
        except Exception as exc:
            cause = getattr(exc, "cause", None)  # what the actor's call raised, under Ray's wrapper
            if isinstance(cause, ValueError):
                raise ListenFailed(str(cause)) from None
            raise ChannelBroken(f"the actor at the other end is gone ({type(exc).__name__})") from None


class _Near:
    """What both near ends do alike: once the shared-memory end is there, it is the channel."""

    _near: Any

    def traffic(self) -> Traffic:
        return self._near.traffic() if self._near is not None else super().traffic()  # type: ignore[misc]

    def watch(self, *waitables: Any) -> None:
        super().watch(*waitables)  # type: ignore[misc]
        if self._near is not None:
            self._near.watch(*waitables)

    def connected(self) -> bool:
        return self._near is not None or super().connected()  # type: ignore[misc]


class NearSender(_Near, StreamSender):
    """A sending end that listens in its actor on TCP and, for a peer on its node, on a
    Unix-domain socket too (``listen_here``); at its first use it takes whichever peer
    came (each proved the secret): a TCP connection, or a shared-memory channel handed
    over by that peer (``transport/handover.py``), which it then uses for everything.
    Where nothing listens on the Unix side (a connecting end), it is a ``StreamSender``."""

    def _setup(self) -> None:
        super()._setup()
        self._near: Any = None  # the ShmSender, once handed over

    def _settle(self, deadline: float | None) -> Any:
        """The shared-memory end if the peer chose it; None for the stream (or while
        ``deadline`` passes with no peer: the stream's own wait then says so)."""
        if self._near is not None or self._sock is not None or self._address is not None or self._closed:
            return self._near
        near_key = _near_spec(self._spec).key
        tcp = self._listener(deadline)  # listen_here made the Unix one before it, if any
        if _registered(near_key) is None:
            return None  # nobody offered the Unix side: the stream alone
        from ...transport.handover import take_sender

        while True:
            unix = _registered(near_key)
            if unix is None:
                return None
            left = RECHECK_SECONDS if deadline is None else min(RECHECK_SECONDS, deadline - time.monotonic())
            hits = poll_waitables([tcp.ready_fd(), unix.ready_fd(), *self._watched], max(0.0, left))
            if unix.ready_fd() in hits:
                self._near = take_sender(_near_spec(self._spec), 0.0, self._watched)
                self._near.watch(*self._watched)
                _drop_listener(self._spec.key)
                return self._near
            if tcp.ready_fd() in hits:
                _drop_listener(near_key)  # the stream it is
                return None
            if hits:
                raise ChannelBroken("a watched process ended while waiting for the other end to connect")
            if left <= 0:
                return None

    def send(self, obj: Any, timeout: float | None = None) -> None:
        if self._closed:
            raise ChannelClosed("send on a closed channel")
        deadline = None if timeout is None else time.monotonic() + timeout
        near = self._settle(deadline)
        if near is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return super().send(obj, left)
        return near.send(obj, None if deadline is None else max(0.0, deadline - time.monotonic()))

    def peer_waiting(self) -> bool:
        return self._near.peer_waiting() if self._near is not None else False

    def close(self) -> None:
        near, self._near = self._near, None
        if near is not None:
            self._closed = True
            near.close()
            return
        _drop_listener(_near_spec(self._spec).key)
        super().close()

    def release(self) -> None:
        near, self._near = self._near, None
        if near is not None:
            near.release()
        _drop_listener(_near_spec(self._spec).key)
        super().release()


class NearReceiver(_Near, StreamReceiver):
    """A receiving end that connects to an actor's ``NearSender``: when that actor runs
    on this process's node (by node id: the nodes of one host share its address), it
    opens a shared-memory channel here and hands its sending end over (a Unix-domain
    socket, ``transport/handover.py``), then reads the channel as a local worker's
    parent does, lend area included; otherwise it is a ``StreamReceiver``."""

    def _setup(self) -> None:
        super()._setup()
        self._near: Any = None  # the ShmReceiver, once handed over (or landed)
        self._armed_near = False
        # Set by the placement on the ends the training process reads: a stream from another
        # node lands in shared memory through a landing process (``transport/landing.py``).
        self.land = False
        self._landing: Any = None
        self._failed_here: str | None = None  # why it could not be set up here

    def problem_here(self) -> str | None:
        """Why this end failed in this process: its landing process ended early (its
        stream broke, or it was killed) or could not start, or the sender could not listen
        where the service said; None otherwise."""
        landing = self._landing
        if landing is None:
            return self._failed_here
        problem = landing.problem()
        return problem + _LANDING_ADVICE if problem and self.failed_here() else problem

    def failed_here(self) -> bool:
        """This end failed for a reason of this process or of the service's settings (its
        landing process could not start or was killed; the sender could not listen): not
        because its stream broke (that is the sender's end, which its watcher tells)."""
        landing = self._landing
        if landing is None:
            return self._failed_here is not None
        from ...transport.landing import BROKEN

        return landing.process.poll() not in (None, 0, BROKEN)

    def _settle(self, deadline: float | None) -> Any:
        """The shared-memory end, made now if the sender is on this node; None for the
        stream, or while the sender's answer is not known by ``deadline``."""
        address = self._address
        if self._near is not None or self._sock is not None or self._closed or self._broken is not None:
            return self._near
        if not isinstance(address, ActorAddress):
            return None
        while True:
            left = RECHECK_SECONDS if deadline is None else min(RECHECK_SECONDS, deadline - time.monotonic())
            try:
                found = address.answer(max(0.0, left))
            except ListenFailed as exc:
                self._broken = self._failed_here = str(exc)
                raise
            if found is not None:
                break
            if deadline is not None and time.monotonic() >= deadline:
                return None
            if self._watched and poll_waitables(list(self._watched), 0):
                raise ChannelBroken("a watched process ended before the other end's address was known")
        host, port, node, name = found
        if node != this_node() and self.land:
            from ...transport.landing import Landing

            try:
                self._landing = Landing.start((host, port), self._spec, self._watched)
            except OSError as exc:
                self._broken = self._failed_here = f"could not start the landing process of a stream ({exc}){_LANDING_ADVICE}"
                raise ChannelBroken(self._broken) from None
            self._near = self._landing.receiver
            return self._near
        if name is None or node != this_node():
            self._address = (host, port)
            return None
        from ...transport.handover import hand_over

        try:
            self._near = hand_over(name, _near_spec(self._spec))
        except ChannelBroken as exc:
            self._broken = str(exc)
            raise
        self._near.watch(*self._watched)
        return self._near

    def _now(self) -> Any:
        """``_settle`` without waiting for the answer (a hand-over, once the answer is
        there, is bounded by the handshake's bound)."""
        try:
            return self._settle(time.monotonic())
        except ChannelBroken:
            return None  # recorded: the stream's methods raise it

    def recv(self, timeout: float | None = None) -> Any:
        if self._closed:
            raise ChannelClosed("receive on a closed channel")
        deadline = None if timeout is None else time.monotonic() + timeout
        near = self._settle(deadline)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if near is None:
            if self._undecided():
                raise TimeoutError(f"no message within {timeout} s (the other end's address is not known yet)")
            return super().recv(left)
        return near.recv(left)

    def _undecided(self) -> bool:
        """Which end this is (shared memory, landed, or the stream read here) is not known
        yet: the answer of the sender's actor has not come. The stream's own methods must
        not run then: one that found the answer a moment later would connect straight to
        the sender over TCP, skipping the hand-over or the landing that ``_settle`` chooses."""
        return isinstance(self._address, ActorAddress) and self._sock is None and self._broken is None

    def skip(self) -> bool:
        return self._look("skip")

    def poll(self) -> bool:
        return self._look("poll")

    def has_input(self) -> bool:
        return self._look("has_input")

    def _look(self, name: str) -> bool:
        """``skip``, ``poll`` or ``has_input`` (none of them waits) of whichever end this
        is; False while that is not decided (a closed end still raises as the stream's)."""
        near = self._now()
        if near is not None:
            return getattr(near, name)()
        if self._undecided() and not self._closed:
            return False
        return getattr(super(), name)()

    def arm(self) -> Any:
        near = self._near
        self._armed_near = near is not None
        return near.arm() if near is not None else super().arm()

    def disarm(self, woken: bool, timed_out: bool = False) -> None:
        if self._armed_near:
            self._armed_near = False
            self._near.disarm(woken, timed_out)

    def close(self) -> None:
        near = self._near
        if near is not None:
            near.close()
        if self._landing is not None:
            # Asked now, waited for by ``release`` (the placement's, at its close): the
            # landing processes of every worker end side by side, not one after another.
            self._landing.request_stop()
            _StreamEndpoint.release(self)  # this end's own socket or listener, if any
            return
        super().close()

    def release(self) -> None:
        near, self._near = self._near, None
        if near is not None:
            near.release()
        self._stop_landing()
        super().release()

    def _stop_landing(self) -> None:
        if self._landing is not None:
            self._landing.stop()  # bounded; the problem it found stays readable


# -- control channels: Ray calls into a box -----------------------------------------------


@dataclass(eq=False)
class ChannelSpec:
    """What both ends of one control channel know, in the training process: its id and
    capacity, and the actor that hosts its receiver (set by the placement when it starts
    that actor)."""

    cid: str
    capacity: int
    control: bool = True
    host: Any = None  # the receiver's actor
    early: list[Any] = field(default_factory=list)  # messages sent before the host existed


def open_ray_channel(
    *, capacity_items: int, capacity_bytes: int, control: bool = True
) -> tuple[RaySender, RayReceiver]:
    """A control channel over Ray calls holding at most ``capacity_items`` unanswered
    deliveries (``capacity_bytes`` is not enforced: control messages are small)."""
    del capacity_bytes
    if not control:
        raise ValueError("internal error: the Ray backend's data channels are streams (open_stream_channel)")
    if isinstance(capacity_items, bool) or not isinstance(capacity_items, int) or capacity_items < 1:
        raise ValueError(f"capacity_items must be an int >= 1, got {capacity_items!r}")
    spec = ChannelSpec(uuid.uuid4().hex, capacity_items)
    return RaySender(spec), RayReceiver(spec)


class _Box:
    def __init__(self) -> None:
        self.cv = threading.Condition(threading.Lock())
        self.queue: deque[Any] = deque()
        self.closed = False
        self.next_seq = 0  # the next message in order
        self.early: dict[int, tuple[Any, bool]] = {}  # arrived before their turn


_boxes: dict[str, _Box] = {}
_boxes_lock = threading.Lock()


def _box(cid: str) -> _Box:
    with _boxes_lock:
        box = _boxes.get(cid)
        if box is None:
            box = _boxes[cid] = _Box()
        return box


def drop_box(receiver: RayReceiver) -> None:
    """In the receiver's actor, once its child ended: forget the receiver's box."""
    with _boxes_lock:
        _boxes.pop(receiver._spec.cid, None)


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


class RaySender:
    """The sending end, in the training process: calls the receiver's actor, at most
    ``capacity`` calls unanswered."""

    def __init__(self, spec: ChannelSpec) -> None:
        self._spec = spec
        self._open = True
        self._watched: list[Any] = []
        self._calls: deque[Any] = deque()
        self._seq = 0
        self._messages = 0

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("internal error: a control sender stays in the training process")

    def send(self, obj: Any, timeout: float | None = None) -> None:
        if not self._open:
            raise ChannelClosed("send on a closed channel: this sender was closed or released")
        self._push(obj, False, timeout)

    def peer_waiting(self) -> bool:
        """Unknown: the child's reads are not seen from here."""
        return False

    def borrow(self, nbytes: int) -> None:
        """No lend area here: buffers are built in ordinary memory."""
        return None

    def close(self) -> None:
        """End of stream: the receiver gets every message sent, then ``EndOfStream``."""
        if not self._open:
            return
        self._open = False
        try:
            self._push(None, True, 0)
        except Exception:
            pass  # the receiver's actor is gone or stuck: it ends with it

    def release(self) -> None:
        """Nothing held here but calls in flight."""

    def watch(self, *waitables: Any) -> None:
        self._watched.extend(waitables)

    def traffic(self) -> Traffic:
        return Traffic(self._messages, 0, 0, 0)

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
        get_without_cycle(ref, timeout=0)
    except Exception as exc:
        raise ChannelBroken(f"the actor at the other end is gone ({type(exc).__name__})") from None


class RayReceiver:
    """The receiving end, in the child's actor: reads its box. Its waiter looks at it on
    a short interval (``arm`` gives no waitable): control messages are rare."""

    def __init__(self, spec: ChannelSpec) -> None:
        self._spec = spec
        self._box: _Box | None = None  # set in the actor
        self._closed = False
        self._messages = 0

    def __getstate__(self) -> dict[str, Any]:
        spec = self._spec
        early, spec.early = spec.early, []  # they travel with the receiver, once
        return {"cid": spec.cid, "capacity": spec.capacity, "host": spec.host, "early": early}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(ChannelSpec(state["cid"], state["capacity"], True, state["host"]))  # type: ignore[misc]
        self._box = _box(state["cid"])
        for seq, message, last in state["early"] or ():
            serve_deliver(state["cid"], seq, message, last)

    def recv(self, timeout: float | None = None) -> Any:
        box = self._live()
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

    def skip(self) -> bool:
        """Drop the next message unread; False when none is here now (never blocks)."""
        box = self._live()
        with box.cv:
            if box.queue:
                box.queue.popleft()
                return True
            if box.closed:
                raise EndOfStream()
            return False

    def has_input(self) -> bool:
        """``recv`` would not block: a message, or the end of the stream."""
        box = self._box
        return box is None or self._closed or bool(box.queue) or box.closed

    poll = has_input

    def watch(self, *waitables: Any) -> None:
        """Nothing to watch: the box is filled by calls, which end with the caller."""

    def close(self) -> None:
        self._closed = True

    def release(self) -> None:
        """The training process's copy of an end an actor owns: nothing to let go of."""

    def traffic(self) -> Traffic:
        box = self._box
        queued = 0 if box is None else len(box.queue)
        return Traffic(self._messages + queued, 0, queued, 0)

    def wait(self, timeout: float | None = None, also: Sequence[Any] = ()) -> list[Any]:
        """This receiver alone, by the protocol every receiver follows."""
        return wait_together([self], timeout, also)

    def arm(self) -> None:
        """No waitable: a waiter looks again on a short interval."""
        return None

    def disarm(self, woken: bool, timed_out: bool = False) -> None:
        """Nothing armed."""

    def _live(self) -> _Box:
        if self._closed:
            raise ChannelClosed("recv on a closed channel")
        if self._box is None:
            raise ChannelClosed("internal error: a control receiver is read only in its child's actor")
        return self._box


def _ready(waitables: list[Any]) -> bool:
    return bool(waitables) and bool(poll_waitables(waitables, 0))
