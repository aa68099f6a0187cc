"""Bounded one-way channels between processes. Knows nothing of DataPipes or torch.

    sender, receiver = open_channel(ctx, capacity_items=..., capacity_bytes=...)

The endpoints implement ``Sender`` and ``Receiver``, declared once in ``channel.py``;
the runtime calls nothing else on them:

    Sender.send(obj, timeout)   # blocks while the channel is full: backpressure; timeout
                                #   (0: a try) then TimeoutError, nothing sent
    Sender.peer_waiting()       # -> the receiver is blocked waiting for data now
    Sender.borrow(nbytes)       # -> a writable buffer in the memory a message crosses in, to
                                #    build a large buffer in and send it uncopied; or None
    Sender.close()              # end of stream
    Receiver.recv(timeout)      # -> obj | raises EndOfStream / ChannelBroken / TimeoutError
    Receiver.skip()             # -> True: the next message was dropped unread; False: none
                                #    is buffered (never blocks)
    Receiver.poll(), .has_input()  # recv would not block (has_input: without a system call)
    endpoint.watch(sentinel)    # a ready waitable while blocked means: the sender is gone
    endpoint.release()          # drop this process's handle of an endpoint another one owns
    endpoint.traffic()          # -> Traffic: messages and bytes so far, and still queued
    wait_readable(receivers, timeout, also)  # the ready ones, of any transports together
                                #   (the protocol: channel.py; Receiver.wait / arm / disarm)

and the module functions of the transport in use:

    release_all_except(keep)    # in a forked child: drop every inherited endpoint but these
    register_reducer(cls, fn)   # a faster pickling for one type, in this transport only
    register_stream_key(fn)     # messages pickled once per name (fn names them), then reused
    lending()                   # -> Lending: large buffers this process received as views of
                                #    shared memory, or copied; and those its users hold now

Both endpoints may be handed to a child process when it is started; each endpoint has
exactly one owner process after that.

Two implementations of the interface carry messages between processes, with the same
capacity limits, the same errors, the same figures and the same lending of large buffers
(``_lend.py``): shared-memory rings (``shm.py``, the default on Linux x86-64, where memfd
exists and the ring's memory ordering argument holds) and OS pipes (``pipe.py``,
everywhere else: the kernel orders its hand-overs on any processor). Both make their
shared memory the same way (``_memory.py``: a memfd, else an unlinked POSIX
shared-memory object or file; ``MPRS_PLUS_LEND_MEMORY`` forces one). The environment variable ``MPRS_PLUS_TRANSPORT`` (``shm``,
``pipe``, or ``auto``, the default) chooses one when this package is first imported; child
processes inherit the choice. ``TRANSPORT`` says which is in use. A third, ``inprocess.py``,
carries them between the threads of one process (for tests of the runtime), written from
the protocols alone.
"""

import os
import platform

from ._wakeup import note_blocking
from .channel import Endpoint, Receiver, Sender, wait_readable
from .errors import ChannelBroken, ChannelClosed, ChannelError, EndOfStream
from .serialize import register_reducer, register_stream_key
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
else:
    from .pipe import lending
    from .pipe import open_pipe_channel as open_channel
    from .pipe import release_all_except

__all__ = [
    "TRANSPORT",
    "ChannelBroken",
    "ChannelClosed",
    "ChannelError",
    "EndOfStream",
    "Endpoint",
    "Lending",
    "Receiver",
    "Sender",
    "Traffic",
    "open_channel",
    "lending",
    "note_blocking",
    "register_reducer",
    "register_stream_key",
    "release_all_except",
    "wait_readable",
]
