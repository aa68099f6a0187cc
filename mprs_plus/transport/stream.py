"""Channels over one TCP connection between two processes, on one host or two.

    StreamSender.send(obj) --[u64 size][frame]--> one TCP connection --> StreamReceiver.recv()
                           <-- [u32 messages read] -- credits, on the same connection

One end listens, the other connects: ``listen(spec)`` binds a listening socket in the
process where the listening end will run (on ``spec.host``, loopback unless told otherwise:
never every interface by default) and returns its address; that address reaches the other
process by whatever carries the endpoint there (a pickled endpoint, a call of the caller's
scheduler), and that end connects at its first use. An address may also be given as a
function ``resolve(timeout) -> (host, port) | None`` (None: not known yet), so an endpoint
can travel before the address exists.

Authentication, before one byte is unpickled
    Each channel's ``StreamSpec`` holds a secret (``secrets.token_bytes``) that both ends
    know. A connection proves it in both directions, as ``multiprocessing.connection``'s
    authkey does, bound to the channel's key so that a proof for one channel is worth
    nothing on another:

        listener                                     connector
        MAGIC + nonce_l (32 random bytes)  ------->
                                           <-------  HMAC(secret, "C" key nonce_l) + nonce_c
        checks it; HMAC(secret, "S" key nonce_c) -->  checks it

    The listener runs the handshakes in a thread of its own, all at once, each bounded by
    ``HANDSHAKE_SECONDS``: a connection that fails the proof, sends anything else (a pickle,
    garbage), closes, or stays silent is closed and counted (``refused_connections()``),
    and the listener goes on waiting for its peer; a stranger never holds up the peer. Once
    the peer is in, the listening socket is closed: one connection per channel. Nothing is
    encrypted: whoever sees the traffic sees the items (see the docs' security section).

Frames and credits
    A message is ``[u64 size]`` then the frame of ``_frame.py`` (the pipe transport's, the
    same pickling); a size of 0 ends the stream. The receiver reads the socket in chunks
    (many small messages per system call) and receives each large buffer straight into a
    ``bytearray`` of its own with ``recv_into``: a numpy array or tensor is rebuilt over it
    without a further copy. It counts the messages it has read and returns them as credits
    (a u32 count), gathered until a quarter of the capacity is read. The sender keeps the
    size of each message not yet credited and waits while ``capacity_items`` messages or
    ``capacity_bytes`` bytes are (a larger message goes alone): the backpressure of the
    pipe transport, over a network. A sender about to wait for room first writes a request
    (a size of 2**64-1) after its last message; the receiver answers it with the credits it
    holds when it reaches it, having then read everything sent before. So a receiver that
    waits for data sends nothing, and a full sender always hears of the room it has.

Waits, and a peer that is gone
    Every wait is a ``poll`` of the socket (which holds the data or the credits themselves:
    no separate wake-up that could be lost) and of the waitables given to ``watch``, in
    slices of ``RECHECK_SECONDS``. A peer that closes or crashes shows as end-of-file or a
    reset: ``ChannelBroken``, also when it stops in the middle of a message (never a
    truncated item). A peer that goes silent without a word (a host lost without a FIN) is
    found by TCP keepalive and ``TCP_USER_TIMEOUT`` (``KEEPALIVE``), and by the watched
    waitables of the caller (a process sentinel, a liveness watch). A message begun but not
    continued for ``STALL_SECONDS`` breaks the channel too.

    Closing: the sender writes the end-of-stream marker, shuts its direction down, and
    keeps the socket (reading credits) until the receiving kernel has acknowledged every
    byte, at most ``LINGER_SECONDS``: closed earlier, a credit arriving late would make the
    kernel reset the connection and drop what it had not sent.

Pickling an endpoint carries its spec and address, never a socket: an endpoint is
connected by the process that uses it, and cannot move after that.
"""

from __future__ import annotations

import hmac
import os
import secrets
import select
import socket
import struct
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

try:
    import fcntl
    import termios
except ImportError:  # pragma: no cover - not on Windows
    fcntl = termios = None  # type: ignore[assignment]

from . import _frame
from ._wakeup import asleep
from .channel import RECHECK_SECONDS, poll_waitables, wait_together
from .errors import ChannelBroken, ChannelClosed, EndOfStream
from .serialize import Encoder
from .traffic import Traffic

# A connection proves the secret within this, or is dropped. A stranger that stays silent
# holds up nobody (handshakes run side by side), so the bound is the peer's: 5 s was too
# short for a Ray actor's listener thread beside two test suites on two cores (load 10).
HANDSHAKE_SECONDS = 30.0
CONNECT_SECONDS = 10.0  # a connector reaches the listener within this
STALL_SECONDS = 60.0  # a message begun and not continued for this long breaks the channel
CLOSE_SECONDS = 1.0  # the longest a close waits for room for the end-of-stream marker
LINGER_SECONDS = 10.0  # ... and then for the receiving kernel to have taken every byte
_LINGER_LOOK = 0.005
# Keepalive: the first probe after 10 s of silence, then every 5 s, 3 unanswered: a peer
# lost without a FIN is an error within about 25 s; unacknowledged data for 30 s too.
KEEPALIVE = (10, 5, 3)
USER_TIMEOUT_MS = 30_000
CHUNK = 256 << 10  # bytes a receiver asks the kernel for at once

_MAGIC = b"mprs+st1"
_NONCE = 32
_DIGEST = 32  # sha256
_SIZE = struct.Struct("<Q")
_CREDIT = struct.Struct("<I")
_END = _SIZE.pack(0)
_REQUEST_SIZE = (1 << 64) - 1  # in a size's place: "send the credits you hold"
_REQUEST = _SIZE.pack(_REQUEST_SIZE)
_IOV_MAX = 512  # parts of one sendmsg (the kernel allows 1024)
_MAX_FRAME = 1 << 40  # larger is a corrupt stream, not a message

Address = tuple[str, int]
Resolver = Callable[[float], "Address | None"]

_refused = 0
_refused_lock = threading.Lock()


def refused_connections() -> int:
    """Connections this process's listeners closed because they did not prove the secret
    (a wrong proof, garbage, an early close, or silence past ``HANDSHAKE_SECONDS``)."""
    return _refused


def _count_refused() -> None:
    global _refused
    with _refused_lock:
        _refused += 1


@dataclass(frozen=True)
class StreamSpec:
    """What both ends of one channel know. ``secret``: shared by the ends, at least 16
    bytes (``new_secret()``); ``host``: where a listening end binds (one interface;
    "0.0.0.0" only if asked for); ``key``: names the channel, in the proofs and in the
    listening process's table of listeners."""

    secret: bytes = field(repr=False)
    capacity_items: int
    capacity_bytes: int
    host: str = "127.0.0.1"
    key: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or len(self.secret) < 16:
            raise ValueError("a stream channel's secret must be at least 16 bytes: use new_secret()")
        for name in ("capacity_items", "capacity_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def new_secret() -> bytes:
    """A fresh random secret for one service's channels."""
    return secrets.token_bytes(32)


# -- the handshake ------------------------------------------------------------------------


def _proof(secret: bytes, role: bytes, key: str, nonce: bytes) -> bytes:
    return hmac.new(secret, role + key.encode() + nonce, "sha256").digest()


def _recv_exactly(sock: socket.socket, n: int, deadline: float) -> bytes:
    data = b""
    while len(data) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the handshake took too long")
        sock.settimeout(left)
        part = sock.recv(n - len(data))
        if not part:
            raise ConnectionError("the other end closed the connection during the handshake")
        data += part
    return data


def connect(address: Address | str, spec: StreamSpec, timeout: float = CONNECT_SECONDS) -> socket.socket:
    """A connection to the listener of ``spec``'s channel at ``address``, both sides
    proved; ``ChannelBroken`` when it cannot be made within ``timeout`` (plus the
    handshake's bound) or the listener does not prove the secret. A ``str`` address is
    a Unix-domain socket's name (``Listener(spec, unix=True)``), for ``handover.py``."""
    where = address if isinstance(address, str) else f"{address[0]}:{address[1]}"
    try:
        if isinstance(address, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout)
                sock.connect(address)
            except OSError:
                sock.close()
                raise
        else:
            sock = socket.create_connection(address, timeout=timeout)
    except OSError as exc:
        raise ChannelBroken(f"could not connect to the other end of the channel at {where!r}: {exc}") from None
    try:
        deadline = time.monotonic() + HANDSHAKE_SECONDS
        hello = _recv_exactly(sock, len(_MAGIC) + _NONCE, deadline)
        if hello[: len(_MAGIC)] != _MAGIC:
            raise ConnectionError("the other end does not speak this protocol")
        nonce = secrets.token_bytes(_NONCE)
        sock.sendall(_proof(spec.secret, b"C", spec.key, hello[len(_MAGIC) :]) + nonce)
        answer = _recv_exactly(sock, _DIGEST, deadline)
        if not hmac.compare_digest(answer, _proof(spec.secret, b"S", spec.key, nonce)):
            raise ConnectionError("the other end did not prove the channel's secret")
    except (OSError, TimeoutError) as exc:
        sock.close()
        raise ChannelBroken(f"the connection to {where!r} failed its handshake: {exc}") from None
    _tune(sock)
    return sock


def _tune(sock: socket.socket) -> None:
    """No delay for small frames; keepalive and a bound on unacknowledged data, so that
    a peer lost without a word breaks the channel (TCP only)."""
    sock.setblocking(False)
    if sock.family == socket.AF_UNIX:
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, count = KEEPALIVE
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    if option is not None:
        sock.setsockopt(socket.IPPROTO_TCP, option, USER_TIMEOUT_MS)


def _unacknowledged(sock: socket.socket) -> int:
    """Bytes written to ``sock`` that its peer's kernel has not acknowledged (Linux's
    ``SIOCOUTQ``; 0 where the system does not say)."""
    if termios is None or not hasattr(termios, "TIOCOUTQ"):
        return 0
    try:
        (count,) = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))
    except OSError:
        return 0
    return count


class _Handshake:
    __slots__ = ("sock", "nonce", "data", "deadline")

    def __init__(self, sock: socket.socket, nonce: bytes, deadline: float) -> None:
        self.sock = sock
        self.nonce = nonce
        self.data = b""
        self.deadline = deadline


class Listener:
    """One channel's listening socket and its handshake thread (see the module's
    docstring). ``take`` hands over the peer's connection once it has proved itself."""

    def __init__(self, spec: StreamSpec, port: int = 0, unix: bool = False) -> None:
        self._spec = spec
        if unix:
            # An abstract name (Linux): no file to remove, gone with the socket. Anyone on
            # the host may connect to it: the handshake keeps them out, as on TCP.
            family, where = socket.AF_UNIX, "\0mprs_plus-" + spec.key
        else:
            family, where = socket.AF_INET6 if ":" in spec.host else socket.AF_INET, (spec.host, port)
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind(where)
            sock.listen(16)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock: socket.socket | None = sock
        self.address: Address | str = where if unix else sock.getsockname()[:2]
        self.refused = 0
        self._peer: socket.socket | None = None
        self._lock = threading.Lock()
        # The thread writes one byte to ``ready`` when it ends (a peer is in, or closed);
        # ``close`` writes one to ``stop``.
        self._ready_r, self._ready_w = os.pipe()
        self._stop_r, self._stop_w = os.pipe()
        self._ended = False
        self._thread = threading.Thread(target=self._serve, name=f"stream listener {spec.key[:8]}", daemon=True)
        self._thread.start()

    def ready_fd(self) -> int:
        """Readable once the peer is in (or the listener ended)."""
        return self._ready_r

    def take(self, timeout: float | None, watched: Sequence[Any] = ()) -> socket.socket:
        """The peer's connection, waiting at most ``timeout`` seconds (None: while the
        watched waitables stay quiet); ``TimeoutError`` then. ``ChannelBroken`` when a
        watched waitable becomes ready first, or the listener was closed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if self._peer is not None:
                    peer, self._peer = self._peer, None
                    return peer
                if self._ended:
                    raise ChannelBroken("the channel's listener was closed before its peer connected")
            left = RECHECK_SECONDS if deadline is None else min(RECHECK_SECONDS, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError("the other end of the channel has not connected")
            hits = asleep(lambda: poll_waitables([self._ready_r, *watched], left))
            if any(h is not self._ready_r for h in hits) and self._peer is None:
                raise ChannelBroken("a watched process ended while waiting for the other end to connect")

    def close(self) -> None:
        """Stop listening; a peer not taken yet is disconnected. Idempotent, bounded."""
        with self._lock:
            stop_w, self._stop_w = self._stop_w, -1
        if stop_w < 0:
            return
        os.write(stop_w, b"\0")
        self._thread.join(2 * RECHECK_SECONDS + 1)
        os.close(stop_w)
        with self._lock:
            peer, self._peer = self._peer, None
        if peer is not None:
            peer.close()
        for fd in (self._ready_r, self._ready_w, self._stop_r):
            try:
                os.close(fd)
            except OSError:
                pass

    def _serve(self) -> None:
        sock = self._sock
        assert sock is not None
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        pending: dict[int, _Handshake] = {}
        try:
            while True:
                now = time.monotonic()
                soonest = min((h.deadline for h in pending.values()), default=now + RECHECK_SECONDS)
                events = poller.poll(max(0, int((soonest - now) * 1000) + 1))
                fds = {fd for fd, _ in events}
                if self._stop_r in fds:
                    return
                if sock.fileno() in fds:
                    self._accept(sock, poller, pending)
                for fd in fds & pending.keys():
                    peer = self._advance(pending[fd])
                    if peer is None:
                        continue
                    poller.unregister(fd)
                    del pending[fd]
                    if peer is not False:
                        with self._lock:
                            self._peer = peer
                        return
                now = time.monotonic()
                for fd in [fd for fd, h in pending.items() if h.deadline <= now]:
                    poller.unregister(fd)
                    self._refuse(pending.pop(fd).sock)
        finally:
            for handshake in pending.values():
                self._refuse(handshake.sock)
            sock.close()
            self._sock = None
            with self._lock:
                self._ended = True
            os.write(self._ready_w, b"\0")

    def _accept(self, sock: socket.socket, poller: Any, pending: dict[int, _Handshake]) -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # out of descriptors, say: the next poll tries again
            conn.setblocking(False)
            nonce = secrets.token_bytes(_NONCE)
            try:
                conn.send(_MAGIC + nonce)  # 40 bytes into a fresh socket's buffer: never short
            except OSError:
                self._refuse(conn)
                continue
            pending[conn.fileno()] = _Handshake(conn, nonce, time.monotonic() + HANDSHAKE_SECONDS)
            poller.register(conn.fileno(), select.POLLIN)

    def _advance(self, handshake: _Handshake) -> socket.socket | bool | None:
        """The connection once proved; False once refused; None while it is not complete."""
        spec, conn = self._spec, handshake.sock
        try:
            part = conn.recv(_DIGEST + _NONCE - len(handshake.data))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            part = b""
        if not part:
            self._refuse(conn)
            return False
        handshake.data += part
        if len(handshake.data) < _DIGEST + _NONCE:
            return None
        proof, nonce = handshake.data[:_DIGEST], handshake.data[_DIGEST:]
        if not hmac.compare_digest(proof, _proof(spec.secret, b"C", spec.key, handshake.nonce)):
            self._refuse(conn)
            return False
        try:
            conn.send(_proof(spec.secret, b"S", spec.key, nonce))
        except OSError:
            self._refuse(conn)
            return False
        _tune(conn)
        return conn

    def _refuse(self, conn: socket.socket) -> None:
        self.refused += 1  # counted before the close: whoever sees the close sees the count
        _count_refused()
        conn.close()


# The listeners of this process, by channel key: ``listen`` makes one, and the endpoint
# that listens takes it at its first use, waiting for it if that comes first (a caller
# may make the listener from another thread, as an actor's call does).
_listeners: dict[str, Listener] = {}
_listeners_cv = threading.Condition(threading.Lock())


def listen(spec: StreamSpec, unix: bool = False) -> Address | str:
    """Listen for the peer of ``spec``'s channel in this process (the listening end will
    be used here), on ``spec.host`` (or on a Unix-domain socket of this host: ``unix``);
    returns the address the other end connects to. Idempotent per channel."""
    with _listeners_cv:
        listener = _listeners.get(spec.key)
        if listener is None:
            listener = _listeners[spec.key] = Listener(spec, unix=unix)
            _listeners_cv.notify_all()
        return listener.address


def _registered(key: str) -> Listener | None:
    with _listeners_cv:
        return _listeners.get(key)


def _drop_listener(key: str) -> None:
    with _listeners_cv:
        listener = _listeners.pop(key, None)
    if listener is not None:
        listener.close()


def close_listeners() -> None:
    """Close every listener of this process whose endpoint has not taken it."""
    with _listeners_cv:
        keys = list(_listeners)
    for key in keys:
        _drop_listener(key)


# -- endpoints ------------------------------------------------------------------------------


class _StreamEndpoint:
    """Either end: its connection, made at its first use (listening, or connecting to
    ``address``)."""

    def __init__(self, spec: StreamSpec, address: Address | Resolver | None = None) -> None:
        self._spec = spec
        self._address = address  # None: this end listens, in the process that uses it
        self._sock: socket.socket | None = None
        self._closed = False
        self._broken: str | None = None
        self._watched: tuple[Any, ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        if self._sock is not None:
            raise TypeError("internal error: a connected stream endpoint cannot move to another process")
        return {"spec": self._spec, "address": self._address}

    def __setstate__(self, state: dict[str, Any]) -> None:
        _StreamEndpoint.__init__(self, state["spec"], state["address"])
        self._setup()

    def _setup(self) -> None:
        """The per-process parts of a subclass, made again after unpickling."""

    def watch(self, *waitables: Any) -> None:
        """While this endpoint blocks, any of these becoming ready means the peer is gone."""
        self._watched = waitables

    def connected(self) -> bool:
        return self._sock is not None

    def release(self) -> None:
        """Drop this process's connection (or listener) without ending the stream."""
        self._closed = True
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        elif self._address is None:
            _drop_listener(self._spec.key)

    def _live(self, deadline: float | None) -> socket.socket:
        """The connection, made now if need be, within ``deadline`` (``TimeoutError``)."""
        if self._closed:
            raise ChannelClosed("use of a closed channel endpoint")
        if self._broken is not None:
            raise ChannelBroken(self._broken)
        sock = self._sock
        if sock is not None:
            return sock
        try:
            if self._address is None:
                listener = self._listener(deadline)
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                sock = listener.take(left, self._watched)
                _drop_listener(self._spec.key)
            else:
                address = self._resolve(deadline)
                sock = connect(address, self._spec)
        except ChannelBroken as exc:
            self._broken = str(exc)
            raise
        self._sock = sock
        return sock

    def _listener(self, deadline: float | None) -> Listener:
        """This end's listener, once ``listen`` has made it in this process."""
        while True:
            with _listeners_cv:
                listener = _listeners.get(self._spec.key)
                if listener is not None:
                    return listener
                left = RECHECK_SECONDS if deadline is None else min(RECHECK_SECONDS, deadline - time.monotonic())
                if left <= 0:
                    raise TimeoutError("the channel does not listen here yet")
                _listeners_cv.wait(left)
            if self._watched and poll_waitables(list(self._watched), 0):
                raise ChannelBroken("a watched process ended before the channel listened")

    def _resolve(self, deadline: float | None) -> Address:
        address = self._address
        if not callable(address):
            assert address is not None
            return address
        while True:
            left = RECHECK_SECONDS if deadline is None else min(RECHECK_SECONDS, deadline - time.monotonic())
            found = address(max(0.0, left))
            if found is not None:
                self._address = found
                return found
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError("the other end's address is not known yet")
            if self._watched and poll_waitables(list(self._watched), 0):
                raise ChannelBroken("a watched process ended before the other end's address was known")

    def _try_live(self) -> socket.socket | None:
        """The connection if it is there or can be made without waiting for the peer (a
        failure to make it is recorded: ``_broken``)."""
        if self._sock is not None or self._closed or self._broken is not None:
            return self._sock
        try:
            if self._address is None:
                listener = _registered(self._spec.key)
                if listener is None or not poll_waitables([listener.ready_fd()], 0):
                    return None
            elif callable(self._address) and self._address(0.0) is None:
                return None
            return self._live(time.monotonic())
        except ChannelBroken as exc:
            self._broken = str(exc)
            return None
        except TimeoutError:
            return None

    @property
    def spec(self) -> StreamSpec:
        return self._spec

    @property
    def key(self) -> str:
        """The channel's key (``StreamSpec.key``)."""
        return self._spec.key

    def connect_to(self, address: Address | Resolver) -> None:
        """Have this end connect to ``address`` at its first use instead of listening."""
        if self._sock is not None:
            raise RuntimeError("internal error: this stream endpoint is connected already")
        self._address = address

    def _wait_io(self, sock: socket.socket, events: int, timeout: float) -> bool:
        """Block until ``sock`` has ``events`` (True) or ``timeout`` passes (False);
        ``ChannelBroken`` when a watched waitable becomes ready first."""
        poller = select.poll()
        poller.register(sock.fileno(), events)
        for waitable in self._watched:
            poller.register(waitable if isinstance(waitable, int) else waitable.fileno(), select.POLLIN)
        hits = asleep(lambda: poller.poll(max(0, int(timeout * 1000))))
        if any(fd == sock.fileno() for fd, _ in hits):
            return True
        if hits:
            raise ChannelBroken("a watched process ended while the channel waited for it")
        return False


class StreamSender(_StreamEndpoint):
    """Writing end. ``send`` blocks while ``capacity_items`` messages or ``capacity_bytes``
    bytes are not yet credited by the receiver (backpressure)."""

    def __init__(self, spec: StreamSpec, address: Address | Resolver | None = None) -> None:
        super().__init__(spec, address)
        self._setup()

    def _setup(self) -> None:
        self._encoder = Encoder()
        self._in_flight: deque[int] = deque()
        self._in_flight_bytes = 0
        self._credit_part = b""
        self._requested = False  # a request for credits is on its way, not yet answered
        self._messages = 0
        self._bytes = 0

    def send(self, obj: Any, timeout: float | None = None) -> None:
        """Pickle ``obj`` and write it; block while the channel is full. ``timeout``
        bounds the wait for the connection and for room: ``TimeoutError``, nothing sent."""
        if self._closed:
            raise ChannelClosed("send on a closed channel")
        encoder = self._encoder
        head, stream, buffers = _frame.encode(encoder, obj)
        try:
            size = len(head) + len(stream) + sum(b.nbytes for b in buffers)
            deadline = None if timeout is None else time.monotonic() + timeout
            sock = self._live(deadline)
            self._wait_for_room(sock, _SIZE.size + size, deadline)
            self._write(sock, [_SIZE.pack(size) + head, stream, *buffers])
        finally:
            encoder.release()
        self._in_flight.append(_SIZE.size + size)
        self._in_flight_bytes += _SIZE.size + size
        self._messages += 1
        self._bytes += _SIZE.size + size

    def peer_waiting(self) -> bool:
        """Unknown over a stream: always False (a batching caller relies on its timer)."""
        return False

    def borrow(self, nbytes: int) -> None:
        """No lend area over a stream: buffers are built in ordinary memory."""
        return None

    def traffic(self) -> Traffic:
        """Messages and bytes written so far, and those not yet read (as the credits say)."""
        sock = self._sock
        if sock is None:
            return Traffic(self._messages, self._bytes, 0, 0)
        try:
            self._take_credits(sock)
        except ChannelBroken:
            pass
        return Traffic(self._messages, self._bytes, len(self._in_flight), self._in_flight_bytes)

    def close(self) -> None:
        """End the stream: the receiver gets everything sent so far, then ``EndOfStream``.
        Waits at most ``CLOSE_SECONDS`` for room for the marker (a receiver that does not
        read then sees a broken channel instead), then at most ``LINGER_SECONDS`` for the
        receiving kernel to have taken every byte: a socket closed with bytes of its peer
        unread (a credit come late) is reset, and a reset drops what was not sent yet
        (what the receiving kernel holds stays readable)."""
        sock = self._sock
        if self._closed or sock is None:
            self.release()
            return
        try:
            if self._broken is None:
                self._write(sock, [_END], CLOSE_SECONDS)
            sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + LINGER_SECONDS
            self._take_credits(sock)
            while _unacknowledged(sock) and time.monotonic() < deadline:
                # Acknowledgements wake no poll: look again every few milliseconds.
                self._wait_io(sock, select.POLLIN, _LINGER_LOOK)
                self._take_credits(sock)
        except (OSError, ChannelBroken, TimeoutError):
            pass  # the receiver is gone, or not reading: it learns from the close itself
        finally:
            self.release()

    def _full(self, size: int) -> bool:
        if not self._in_flight:
            return False
        return len(self._in_flight) >= self._spec.capacity_items or self._in_flight_bytes + size > self._spec.capacity_bytes

    def _wait_for_room(self, sock: socket.socket, size: int, deadline: float | None) -> None:
        self._take_credits(sock)
        while self._full(size):
            left = RECHECK_SECONDS if deadline is None else min(RECHECK_SECONDS, deadline - time.monotonic())
            if not self._requested:
                # Ask for the credits the receiver holds back; it answers once it has read
                # up to here, i.e. everything sent so far.
                self._write(sock, [_REQUEST], max(0.0, left))
                self._requested = True
            if left <= 0:
                raise TimeoutError("no room in the channel within the timeout; nothing was sent")
            self._wait_io(sock, select.POLLIN, left)
            self._take_credits(sock)

    def _take_credits(self, sock: socket.socket) -> None:
        while True:
            try:
                data = sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                raise self._break(f"the receiving end of the channel is gone ({exc})") from None
            if not data:
                raise self._break("the receiver closed the channel, or its process is gone")
            data = self._credit_part + data
            whole = len(data) - len(data) % _CREDIT.size
            self._credit_part = data[whole:]
            for (count,) in _CREDIT.iter_unpack(data[:whole]):
                for _ in range(min(count, len(self._in_flight))):
                    self._in_flight_bytes -= self._in_flight.popleft()
                self._requested = False

    def _write(self, sock: socket.socket, parts: list[Any], bound: float | None = None) -> None:
        """Write every byte of ``parts``; once the first is written the message is
        finished whatever the wait (an unfinished one would corrupt the stream: an
        interruption breaks the channel instead). ``bound``: the longest wait for room
        before the first byte (``TimeoutError``)."""
        views = [memoryview(part).cast("B") for part in parts]
        views = [view for view in views if view.nbytes]
        started = False
        stalled_since = time.monotonic()
        try:
            while views:
                try:
                    sent = sock.sendmsg(views[:_IOV_MAX])
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError as exc:
                    raise self._break(f"the receiving end of the channel is gone ({exc})") from None
                if sent:
                    started, stalled_since = True, time.monotonic()
                while sent:
                    first = views[0]
                    if sent >= first.nbytes:
                        sent -= first.nbytes
                        views.pop(0)
                    else:
                        views[0] = first[sent:]
                        sent = 0
                if not views:
                    return
                waited = time.monotonic() - stalled_since
                if bound is not None and not started and waited >= bound:
                    raise TimeoutError("no room for the message")
                self._wait_io(sock, select.POLLOUT, RECHECK_SECONDS)
                # Room for credits too: a receiver waiting for this message has sent them.
                self._take_credits(sock)
        except BaseException:
            if started and views:
                self._break("a message was interrupted while being written")
            raise

    def _break(self, why: str) -> ChannelBroken:
        self._broken = why
        return ChannelBroken(why)


class StreamReceiver(_StreamEndpoint):
    """Reading end. ``recv`` blocks until a message, the end of the stream, or a gone peer."""

    def __init__(self, spec: StreamSpec, address: Address | Resolver | None = None) -> None:
        super().__init__(spec, address)
        self._setup()

    def _setup(self) -> None:
        self._buf = bytearray(CHUNK)
        self._lo = 0
        self._hi = 0
        self._ended = False
        self._credits = 0  # messages read and not yet credited
        self._credit_bytes = 0
        self._credit_every = max(1, self._spec.capacity_items // 4)
        self._read_messages = 0  # what this end has read so far (``traffic``)
        self._read_bytes = 0
        self._credit_bytes_every = max(1, self._spec.capacity_bytes // 4)

    # The interface ---------------------------------------------------------------------

    def recv(self, timeout: float | None = None) -> Any:
        """The next message; ``timeout`` (seconds, None: forever) bounds the wait for it
        to begin. Raises ``EndOfStream``, ``ChannelBroken``, ``TimeoutError``, or whatever
        unpickling raises (the message is consumed all the same)."""
        return self._read(self._await_message(timeout), keep=True)

    def recv_encoded(
        self, timeout: float | None = None, into: Callable[[int], bytearray] = bytearray
    ) -> tuple[bytes | bytearray, list[bytearray]]:
        """``recv`` without unpickling: the next message's pickle stream and out-of-band
        buffers, for a process that forwards messages to another transport
        (``landing.py``). Each buffer is received into ``into(nbytes)`` (a new
        ``bytearray`` unless the caller reuses its own). The same waits and errors as
        ``recv``."""
        return self._read(self._await_message(timeout), keep=None, into=into)

    def _await_message(self, timeout: float | None) -> socket.socket:
        """The connection, once a message (or the end of the stream) has begun on it."""
        if self._ended:
            raise EndOfStream()
        deadline = None if timeout is None else time.monotonic() + timeout
        sock = self._live(deadline)
        while not self._begun() and not self._pull(sock):
            if not self._wait_io(sock, select.POLLIN, self._slice(deadline)):
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"no message within {timeout} s")
        return sock

    def skip(self) -> bool:
        """Discard the next message without unpickling it; False, without blocking, when
        none has begun arriving (one that has is read through)."""
        if self._ended:
            raise EndOfStream()
        sock = self._try_live()
        if sock is None:
            if self._broken is not None:
                raise ChannelBroken(self._broken)
            self._live(time.monotonic())  # raises ChannelClosed where that is why
            return False
        if not self._begun() and not self._pull(sock):
            return False
        self._read(sock, keep=False)
        return True

    def poll(self) -> bool:
        """True when ``recv`` would return (or raise) without blocking."""
        if self._ended or self._broken is not None:
            return True
        if self._closed:
            raise ChannelClosed("receive on a closed channel")
        sock = self._try_live()
        if sock is None:
            return self._broken is not None
        try:
            return self._begun() or self._pull(sock)
        except ChannelBroken:
            return True  # ``recv`` raises it at once

    has_input = poll

    def wait(self, timeout: float | None = None, also: Sequence[Any] = ()) -> list[Any]:
        """This receiver alone, by the protocol every receiver follows."""
        return wait_together([self], timeout, also)

    def arm(self) -> Any:
        """The socket, readable while data (or its end) is there: nothing to set for a
        sender to wake a waiter. Before the connection: the listener's ready descriptor,
        or None while a connector waits for an address."""
        sock = self._sock
        if sock is not None:
            return sock.fileno()
        if self._closed or self._broken is not None:
            return None
        if self._address is None:
            listener = _registered(self._spec.key)
            return None if listener is None else listener.ready_fd()
        return None

    def disarm(self, woken: bool, timed_out: bool = False) -> None:
        """Nothing to undo or drain: the wake-up is the data itself."""

    def traffic(self) -> Traffic:
        """Messages and bytes read so far at this end: exact and current where the reader
        is, though the sender (in another process, on another node) may have written more;
        what is queued is the sender's to know (0 here)."""
        return Traffic(self._read_messages, self._read_bytes, 0, 0)

    def close(self) -> None:
        """Stop reading: the sender's next ``send`` (or its wait for room) breaks."""
        self.release()

    # Internals ---------------------------------------------------------------------------

    def _slice(self, deadline: float | None) -> float:
        if deadline is None:
            return RECHECK_SECONDS
        return max(0.0, min(RECHECK_SECONDS, deadline - time.monotonic()))

    def _begun(self) -> bool:
        """A message (or the end of the stream) has begun: its size is held. Requests for
        credits at the head are answered and dropped here."""
        while self._hi - self._lo >= _SIZE.size:
            (size,) = _SIZE.unpack_from(self._buf, self._lo)
            if size != _REQUEST_SIZE:
                return True
            self._lo += _SIZE.size
            if self._sock is not None:
                self._flush_credits(self._sock)
        return False

    def _pull(self, sock: socket.socket) -> bool:
        """Take what the socket holds now (never waits); True when a message has begun.
        ``ChannelBroken`` at the end of the connection."""
        if len(self._buf) - self._hi < _SIZE.size:  # only part of a size is held here
            held = self._buf[self._lo : self._hi]
            self._buf[: len(held)] = held
            self._lo, self._hi = 0, len(held)
        try:
            got = sock.recv_into(memoryview(self._buf)[self._hi :])
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            raise self._gone(f"the connection to the sending end broke ({exc})") from None
        if got == 0:
            raise self._gone("the sending end closed the connection without ending the stream")
        self._hi += got
        return self._begun()

    def _read(self, sock: socket.socket, keep: bool | None, into: Callable[[int], bytearray] = bytearray) -> Any:
        """Read one message (its end-of-stream marker raises ``EndOfStream``): unpickled
        (``keep``), dropped (False), or as its pickle stream and buffers (None)."""
        self._fill(sock, _SIZE.size)
        (size,) = _SIZE.unpack_from(self._buf, self._lo)
        if size == 0:
            self._lo += _SIZE.size
            self._ended = True
            self._flush_credits(sock)
            raise EndOfStream()
        if size < _frame.COUNT.size or size > _MAX_FRAME:
            raise self._corrupt(sock)
        self._fill(sock, _SIZE.size + _frame.COUNT.size)
        (nbuf,) = _frame.COUNT.unpack_from(self._buf, self._lo + _SIZE.size)
        head = _SIZE.size + _frame.COUNT.size * (1 + nbuf)
        if head > _SIZE.size + size:
            raise self._corrupt(sock)
        self._fill(sock, head)
        sizes = _frame.lengths(self._buf, self._lo + _SIZE.size)
        stream_size = size - (head - _SIZE.size) - sum(sizes)
        if stream_size < 0:
            raise self._corrupt(sock)
        self._lo += head
        if stream_size <= len(self._buf):
            self._fill(sock, stream_size)
            stream: Any = bytes(memoryview(self._buf)[self._lo : self._lo + stream_size])
            self._lo += stream_size
        else:
            stream = self._read_into(sock, bytearray(stream_size))
        buffers = [self._read_into(sock, into(n)) for n in sizes]
        self._credits += 1
        self._credit_bytes += _SIZE.size + size
        self._read_messages += 1
        self._read_bytes += _SIZE.size + size
        if self._credits >= self._credit_every or self._credit_bytes >= self._credit_bytes_every:
            self._flush_credits(sock)
        if keep:
            return _frame.loads(stream, buffers)
        return None if keep is False else (stream, buffers)

    def _fill(self, sock: socket.socket, n: int) -> None:
        """At least ``n`` bytes held in the chunk buffer, reading as much as comes."""
        if self._hi - self._lo >= n:
            return
        buf = self._buf
        if len(buf) - self._lo < n:  # move what is held to the front (grown if need be)
            held = buf[self._lo : self._hi]
            if n > len(buf):
                buf = self._buf = bytearray(max(n, CHUNK))
            buf[: len(held)] = held
            self._lo, self._hi = 0, len(held)
        view = memoryview(buf)
        while self._hi - self._lo < n:
            self._hi += self._receive(sock, view[self._hi :])

    def _read_into(self, sock: socket.socket, target: bytearray) -> bytearray:
        """``target`` filled from what is held, then straight from the socket."""
        view = memoryview(target)
        got = min(len(target), self._hi - self._lo)
        view[:got] = memoryview(self._buf)[self._lo : self._lo + got]
        self._lo += got
        while got < len(target):
            got += self._receive(sock, view[got:])
        return target

    def _receive(self, sock: socket.socket, into: memoryview) -> int:
        """Some bytes of a message begun: at least one, or ``ChannelBroken`` (end of file,
        a reset, a watched waitable, or ``STALL_SECONDS`` without a byte)."""
        since = time.monotonic()
        while True:
            try:
                got = sock.recv_into(into)
            except (BlockingIOError, InterruptedError):
                got = -1
            except OSError as exc:
                raise self._gone(f"the connection to the sending end broke ({exc})") from None
            if got == 0:
                raise self._gone("the sending end closed the connection without ending the stream")
            if got > 0:
                return got
            if time.monotonic() - since > STALL_SECONDS:
                raise self._gone(f"the sending end sent nothing for {STALL_SECONDS:.0f} s in the middle of a message")
            self._wait_io(sock, select.POLLIN, RECHECK_SECONDS)

    def _flush_credits(self, sock: socket.socket) -> None:
        if not self._credits:
            return
        try:
            sock.send(_CREDIT.pack(self._credits))
        except (BlockingIOError, InterruptedError):
            return  # the kernel's buffer is full of credits the sender has not read: later
        except OSError:
            pass  # the sender is gone, or ended its stream: nobody counts credits any more
        self._credits = 0
        self._credit_bytes = 0

    def _gone(self, why: str) -> ChannelBroken:
        self._broken = why
        self._lo = self._hi = 0
        return ChannelBroken(why)

    def _corrupt(self, sock: socket.socket) -> ChannelBroken:
        return self._gone("the stream holds a malformed message header")


__all__ = [
    "HANDSHAKE_SECONDS",
    "Listener",
    "StreamReceiver",
    "StreamSender",
    "StreamSpec",
    "close_listeners",
    "connect",
    "listen",
    "new_secret",
    "refused_connections",
]
