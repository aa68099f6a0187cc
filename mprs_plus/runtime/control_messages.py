"""Control messages, main process -> each child, as types (data messages: ``data_messages.py``).

    Reset(epoch, payload)    start epoch ``epoch``; payload: (seed_generator, iter_reset_fn);
                             ``skip[k]``: items lane k drops first (a restored epoch);
                             a replacement's ``restore`` and ``lost`` (``main/replacement.py``)
    Pause(epoch, payload)    stop at the next item boundary; payload: pause_fn | None
    Resume(epoch, payload)   go on; payload: resume_fn | None
    Limit(epoch, payload)    payload: (num_batches | None, limit_fn)
    Redeal(worker, payload)  dispatch process only: worker ``worker`` was replaced; payload:
                             per dispatcher, the sending end of a new channel to it
                             (``pack_ends``); deal it again what it was dealt this epoch

There is no STOP message: the main process closes the control channel, and the child's
listener turns the end of the stream into ``Stop()`` (closing never waits, a send could).
A message the listener cannot read at all becomes ``Unreadable(error)``.

Payloads travel pickled on their own (``pack``), so a child that cannot unpickle one (a
function of a module it cannot import) still knows which message, and which epoch, fails.

The types are named tuples, not dataclasses: as immutable, and matched the same way
(``isinstance``, ``case Reset(epoch=e)``), but made without generating code when this
module loads, which every loader's first item waits for. Nothing compares two messages.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
from typing import Any, NamedTuple

from .data_messages import RemoteError


class Reset(NamedTuple):
    epoch: int
    payload: bytes
    skip: tuple[int, ...] = ()  # per lane: items to produce and drop before the first one sent
    # A replacement of a dead worker (``main/replacement.py``): its predecessor's record
    # (the generator states to load once the reset function ran, and the dataset's state
    # where it has one), pickled with the position it was recorded at (``generators.py``),
    # and per lane the position of an item to leave out (one that killed the worker twice),
    # -1 for none.
    restore: bytes = b""
    lost: tuple[int, ...] = ()
    # A replacement hands its first ``careful`` items after the skip on one by one, each
    # before the next is begun: if it dies with no more of them received than its
    # predecessor, the next one is what killed it (the poison rule, ``main/replacement.py``).
    careful: int = 0


class Pause(NamedTuple):
    epoch: int
    payload: bytes


class Resume(NamedTuple):
    epoch: int
    payload: bytes


class Limit(NamedTuple):
    epoch: int
    payload: bytes


class Redeal(NamedTuple):
    """Read by the dispatch process's listener as it arrives (never queued behind a lane
    that waits for room in a channel): see ``child/redeal.py``."""

    worker: int
    payload: bytes


class Stop(NamedTuple):
    """Made by the child's listener when the control channel ends; never sent."""


class Unreadable(NamedTuple):
    """Made by the child's listener for a message that did not unpickle; never sent."""

    error: RemoteError


Control = Reset | Pause | Resume | Limit | Redeal
Received = Control | Stop | Unreadable


def pack(value: Any) -> bytes:
    return pickle.dumps(value, protocol=5)


def pack_ends(value: Any) -> bytes:
    """``value`` holding channel ends, for a child that is running already: multiprocessing's
    pickler hands each descriptor over as the child unpickles it (its resource sharer, a
    Unix socket that checks the process family's key), whichever the transport."""
    from multiprocessing.reduction import ForkingPickler

    return bytes(ForkingPickler.dumps(value, protocol=5))


def take_back_ends(payload: bytes, timeout: float = 2.0) -> None:
    """A ``pack_ends`` payload that never reached its child (the send failed, the service
    stopped, the child died before it read it): fetch each descriptor back from the
    resource sharer, which keeps a copy of it until someone does, and let go of the ends.
    Without this, those copies (a channel's memory and its wake-up pipes) would stay open
    in this process for its whole life. The sharer serves one peer at a time: the fetch
    runs in a helper thread waited for at most ``timeout`` seconds, so that a stop never
    waits on another peer of the sharer that stalls."""
    helper = threading.Thread(target=_take_back, args=(payload,), name="mprs_plus take back", daemon=True)
    try:
        helper.start()
    except RuntimeError:
        return  # the interpreter is exiting (no new thread then): the descriptors go with the process
    helper.join(timeout)


def _take_back(payload: bytes) -> None:
    try:
        ends = pickle.loads(payload)
    except Exception:
        return  # the sharer is gone (interpreter exit): its copies went with it
    for end in ends:
        with contextlib.suppress(Exception):
            end.release()


def unpack(payload: bytes) -> Any:
    return pickle.loads(payload)
