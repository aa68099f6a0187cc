"""Bounded one-way channels between processes. Knows nothing of DataPipes or torch.

    sender, receiver = open_channel(ctx, capacity_items=..., capacity_bytes=...)
    sender.send(obj)          # blocks while the channel is full: backpressure
    sender.send(obj, timeout) # ... at most timeout s (0: a try), then TimeoutError, nothing sent
    sender.peer_waiting()     # -> the receiver is blocked waiting for data now (no system call)
    sender.close()            # end of stream
    receiver.recv(timeout)    # -> obj | raises EndOfStream / ChannelBroken / TimeoutError
    receiver.skip()           # -> True: the next message was dropped unread; False: none is
                              #    buffered (never blocks); raises EndOfStream / ChannelBroken
    receiver.watch(sentinel)  # a ready waitable while blocked means: the sender is gone
    endpoint.release()        # drop this process's handle of an endpoint another one owns
    release_all_except(keep)  # in a forked child: drop every inherited endpoint but these
    register_reducer(cls, fn) # a faster pickling for one type, in this transport only
    endpoint.traffic()        # -> Traffic: messages and bytes so far, and still queued
    lending()                 # -> Lending: large buffers this process received as views of
                              #    shared memory, or copied; and those its users hold now

Both endpoints may be handed to a child process when it is started; each endpoint has
exactly one owner process after that.

Two implementations keep this interface, with the same capacity limits and the same
errors: shared-memory rings (``shm.py``, the default on Linux x86-64, where memfd exists
and the ring's memory ordering argument holds) and OS pipes (``pipe.py``, everywhere
else). The environment variable ``MPRS_PLUS_TRANSPORT`` (``shm``, ``pipe``, or ``auto``,
the default) chooses one when this package is first imported; child processes inherit the
choice. ``TRANSPORT`` says which is in use.
"""

import os
import platform

from ._wakeup import note_blocking
from .errors import ChannelBroken, ChannelClosed, ChannelError, EndOfStream
from .serialize import register_reducer
from .traffic import Lending, Traffic

_SHM_WORKS = hasattr(os, "memfd_create") and platform.machine() in ("x86_64", "AMD64")
_CHOICE = os.environ.get("MPRS_PLUS_TRANSPORT", "auto").strip().lower() or "auto"
if _CHOICE not in ("auto", "shm", "pipe"):
    raise ValueError(f"MPRS_PLUS_TRANSPORT must be 'shm', 'pipe' or 'auto', not {_CHOICE!r}")
if _CHOICE == "shm" and not _SHM_WORKS:
    raise RuntimeError("MPRS_PLUS_TRANSPORT=shm: the shared-memory transport needs Linux on x86-64")

TRANSPORT = "shm" if _CHOICE == "shm" or (_CHOICE == "auto" and _SHM_WORKS) else "pipe"
if TRANSPORT == "shm":
    from ._lend import lending
    from .shm import open_shm_channel as open_channel
    from .shm import release_all_except
    from .shm import wait_readable as _wait_readable
else:
    from .pipe import lending
    from .pipe import open_pipe_channel as open_channel
    from .pipe import release_all_except
    from .pipe import wait_readable as _wait_readable


def wait_readable(receivers, timeout=None, also=()):  # type: ignore[no-untyped-def]
    """The receivers (and ``also`` waitables) ready within ``timeout``; [] on timeout.
    Receivers of another kind of channel (a backend's, ``backends/``) name their own wait
    in ``waits_with``; all the receivers of one wait are of one kind."""
    receivers = list(receivers)
    waits_with = getattr(receivers[0], "waits_with", None) if receivers else None
    if waits_with is not None:
        return waits_with(receivers, timeout, also)
    return _wait_readable(receivers, timeout, also)


__all__ = [
    "TRANSPORT",
    "ChannelBroken",
    "ChannelClosed",
    "ChannelError",
    "EndOfStream",
    "Lending",
    "Traffic",
    "open_channel",
    "lending",
    "note_blocking",
    "register_reducer",
    "release_all_except",
    "wait_readable",
]
