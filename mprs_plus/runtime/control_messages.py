"""Control messages, main process -> each child, as types (data messages: ``data_messages.py``).

    Reset(epoch, payload)    start epoch ``epoch``; payload: (seed_generator, iter_reset_fn);
                             ``skip[k]``: items lane k drops first (a restored epoch)
    Pause(epoch, payload)    stop at the next item boundary; payload: pause_fn | None
    Resume(epoch, payload)   go on; payload: resume_fn | None
    Limit(epoch, payload)    payload: (num_batches | None, limit_fn)

There is no STOP message: the main process closes the control channel, and the child's
listener turns the end of the stream into ``Stop()`` (closing never waits, a send could).
A message the listener cannot read at all becomes ``Unreadable(error)``.

Payloads travel pickled on their own (``pack``), so a child that cannot unpickle one (a
function of a module it cannot import) still knows which message, and which epoch, fails.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from .data_messages import RemoteError


@dataclass(frozen=True, slots=True)
class Reset:
    epoch: int
    payload: bytes
    skip: tuple[int, ...] = ()  # per lane: items to produce and drop before the first one sent


@dataclass(frozen=True, slots=True)
class Pause:
    epoch: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class Resume:
    epoch: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class Limit:
    epoch: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class Stop:
    """Made by the child's listener when the control channel ends; never sent."""


@dataclass(frozen=True, slots=True)
class Unreadable:
    """Made by the child's listener for a message that did not unpickle; never sent."""

    error: RemoteError


Control = Reset | Pause | Resume | Limit
Received = Control | Stop | Unreadable


def pack(value: Any) -> bytes:
    return pickle.dumps(value, protocol=5)


def unpack(payload: bytes) -> Any:
    return pickle.loads(payload)
