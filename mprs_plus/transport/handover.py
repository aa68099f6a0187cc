"""A shared-memory channel between two processes of one host that share no ancestry of
ours (a Ray actor and the training process): the sending end's descriptors cross a
Unix-domain socket (``SCM_RIGHTS``) once both sides have proved the channel's secret.

    sending process                                   receiving process
    name = listen_for_sender(spec)   --- the name, through the caller's scheduler --->
                                                      receiver = hand_over(name, spec)
                                                        opens the shm channel, connects,
                                                        proves the secret both ways
    sender = take_sender(spec)        <-- [u64 ring, u64 lend area, u64 capacity_items]
                                          + memfd, space pipe's read end, data pipe's
                                          write end (SCM_RIGHTS); then it lets go of
                                          its copies, and the socket is closed

The handshake is the stream transport's (``stream.Listener`` on an abstract Unix name,
``stream.connect``): a connection that fails it is closed and counted
(``stream.refused_connections()``), and the receiving process checks the listener's proof
before it sends a descriptor, so the memory never reaches a process that took the name
first. Nothing is unpickled on that socket.

After the hand-over the two ends are those of ``shm.open_shm_channel``, with one owner
each: the receiving process holds no write end of the data pipe and the sending process
no write end of the space pipe, so a peer that dies is end-of-file on its pipe
(``ChannelBroken``), as between a local worker and its parent; ``watch`` adds the
caller's sentinels. Every wait here is bounded and looks at the watched waitables.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

from ._ring import close_fds
from ._sender import ShmSender
from .channel import RECHECK_SECONDS, poll_waitables
from .errors import ChannelBroken
from .shm import ShmReceiver, open_shm_channel
from .stream import HANDSHAKE_SECONDS, StreamSpec, _drop_listener, _registered, connect, listen

_SIZES = struct.Struct("<QQQ")  # ring bytes, lend area bytes, capacity_items


def listen_for_sender(spec: StreamSpec) -> str:
    """In the process that will send: listen for the receiving process on a Unix-domain
    socket of this host; the name to hand to it. Idempotent per channel."""
    name = listen(spec, unix=True)
    assert isinstance(name, str)
    return name


def hand_over(name: str, spec: StreamSpec, timeout: float = HANDSHAKE_SECONDS) -> ShmReceiver:
    """In the receiving process: a shared-memory channel of ``spec``'s capacities whose
    sending end goes to the process listening at ``name``; its receiving end.
    ``ChannelBroken`` when that process cannot be reached or does not prove the secret
    (nothing was sent to it then)."""
    sock = connect(name, spec, timeout)
    try:
        capacities = {"capacity_items": spec.capacity_items, "capacity_bytes": spec.capacity_bytes}
        sender, receiver = open_shm_channel(None, **capacities)
        try:
            sizes, fds = sender.descriptors()
            sock.setblocking(True)
            sock.settimeout(timeout)
            socket.send_fds(sock, [_SIZES.pack(*sizes)], list(fds))
        except OSError as exc:
            receiver.release()
            raise ChannelBroken(f"could not hand the channel to the process at {name!r}: {exc}") from None
        finally:
            # In flight, the descriptors are the kernel's: the peer has them, or they close
            # with the socket (its end of the channel then reads end-of-file).
            sender.release()
    finally:
        sock.close()
    return receiver


def take_sender(spec: StreamSpec, timeout: float | None = None, watched: Sequence[Any] = ()) -> ShmSender:
    """In the sending process: the sending end that the receiving process hands over on
    the socket ``listen_for_sender`` made, waiting at most ``timeout`` seconds (None:
    while the watched waitables stay quiet) for it to connect; ``TimeoutError`` then,
    ``ChannelBroken`` when a watched waitable becomes ready first or the hand-over fails."""
    listener = _registered(spec.key)
    if listener is None:
        raise RuntimeError("internal error: take_sender before listen_for_sender in this process")
    sock = listener.take(timeout, watched)
    _drop_listener(spec.key)
    try:
        return _receive(sock, time.monotonic() + HANDSHAKE_SECONDS, watched)
    finally:
        sock.close()


def _receive(sock: socket.socket, deadline: float, watched: Sequence[Any]) -> ShmSender:
    while not poll_waitables([sock], 0):
        left = deadline - time.monotonic()
        if left <= 0:
            raise ChannelBroken("the receiving process proved the secret but sent no channel")
        if poll_waitables([sock, *watched], min(RECHECK_SECONDS, left)) and not poll_waitables([sock], 0):
            raise ChannelBroken("a watched process ended while the channel was handed over")
    try:
        data, fds, flags, _ = socket.recv_fds(sock, _SIZES.size, 3, socket.MSG_CMSG_CLOEXEC)
    except OSError as exc:
        raise ChannelBroken(f"the channel's hand-over failed: {exc}") from None
    if len(data) != _SIZES.size or len(fds) != 3 or flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
        close_fds(fds)
        raise ChannelBroken("the channel's hand-over was cut short (the receiving process is gone?)")
    return ShmSender.from_descriptors(_SIZES.unpack(data), fds)


__all__ = ["hand_over", "listen_for_sender", "take_sender"]
