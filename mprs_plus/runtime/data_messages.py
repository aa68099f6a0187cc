"""The data protocol between the dispatch, worker and main processes (control messages,
main -> each child, are typed: ``protocol.py``).

Every data message is a tuple ``(kind, epoch, payload)``; tuples pickle fastest.

    dispatcher d --data--> worker w   ITEMS(epoch, [item, ...]) ... END(epoch) | ERROR(epoch, RemoteError)
    worker w, output k --data--> main ITEMS(epoch, [item, ...]) ... END(epoch) | ERROR(epoch, RemoteError)

There is one data channel per (dispatcher, worker) and per (worker, worker output), each
with exactly one writing thread; see ``lanes.py`` for why that keeps the service free of
deadlocks.

Items travel in batches (see ``batching.py``): a reader takes them one by one, so order and
round-robin are per item, whatever the batch sizes.

``epoch`` increases with every ``Reset``, so a reader drops whatever a producer sent for an
epoch the main process has already abandoned (a loop broken off early, say).
"""

from __future__ import annotations

import enum
import os
import pickle
import traceback
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from torch.utils.data import IterDataPipe, MapDataPipe

from ..errors import WorkerError


class Kind(enum.IntEnum):
    ITEMS = 10
    END = 11
    ERROR = 12

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # Travel as a plain int: cheaper, and unpickling needs no import of this module
        # (which may already be torn down when a stop runs at interpreter exit).
        return int, (self.value,)




@dataclass(frozen=True)
class RemoteError:
    """An exception captured in a child process, ready to be raised again in the main one.

    Raised the way torch's DataLoader and torchdata raise a worker's exception, so code
    that reads ``str(exc)`` works unchanged: the same type, built from one message

        Caught ValueError in worker process 0 (pid 4242).
        Original Traceback (most recent call last):
          ...
        ValueError: bad sample 5

    The type travels on its own (pickled by reference), so it survives even when the
    exception's other attributes cannot be pickled; those that can are copied over.
    """

    type_pickled: bytes | None  # the exception's class, when main can import it
    pickled: bytes | None  # the exception itself, when it survives a pickle round trip
    type_name: str
    message: str
    traceback_text: str
    where: str  # "worker process 1 (pid 4242)"
    datapipe: str | None  # the innermost DataPipe on the failing stack

    @classmethod
    def capture(cls, exc: BaseException, where: str) -> RemoteError:
        passed_on = getattr(exc, _ORIGIN, None)
        if isinstance(passed_on, RemoteError):
            # Raised again as it arrived (a dispatch error in a worker): it still names
            # the process where it happened, not the one that passes it on.
            return passed_on
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(
            type_pickled=_round_trip(type(exc)),
            pickled=_round_trip(exc),
            type_name=type(exc).__name__,
            message=str(exc),
            traceback_text=text,
            where=where,
            datapipe=_innermost_datapipe(exc.__traceback__),
        )

    def context(self) -> str:
        by = f" by {self.datapipe}" if self.datapipe else ""
        return f"raised in {self.where}{by}"

    def text(self) -> str:
        """torch's wording: which type, where, then the original traceback."""
        return f"Caught {self.type_name} in {self.where}.\nOriginal {self.traceback_text.rstrip()}"

    def rebuild(self) -> BaseException:
        """The original type built from ``text()``, as torch does.

        Falls back, in order, to the original exception object with ``text()`` as a note
        (its constructor does not take one message), then to ``WorkerError`` carrying
        ``text()`` (its type cannot be imported in the main process).
        """
        text = self.text()
        kind = _load(self.type_pickled)
        original = _load(self.pickled)
        exc: BaseException | None = None
        if isinstance(kind, type) and issubclass(kind, BaseException):
            try:
                # KeyError's str() is the repr of its argument: keep the text readable.
                exc = kind(_VerbatimText(text) if issubclass(kind, KeyError) else text)
            except Exception:
                exc = None
        if exc is not None and isinstance(original, BaseException):
            try:  # attributes such as errno or a custom field still read as raised
                for name, value in vars(original).items():
                    if name not in ("__notes__", "__traceback__", _ORIGIN):
                        setattr(exc, name, value)
            except Exception:
                pass
        if exc is None and isinstance(original, BaseException):
            exc = original
            exc.add_note(text)
        if exc is None:
            exc = WorkerError(text)
        exc.add_note(f"({self.context()})")
        try:
            setattr(exc, _ORIGIN, self)
        except Exception:  # no instance dict: it would be wrapped again if passed on
            pass
        return exc


_ORIGIN = "_mprs_plus_remote_error"  # on a rebuilt exception: where it came from


class _VerbatimText(str):
    """A message whose repr is itself, so that ``str(KeyError(msg))`` shows it as is."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


def _round_trip(obj: Any) -> bytes | None:
    """``obj`` pickled, if it also unpickles here (a sign it will in the main process)."""
    try:
        data = pickle.dumps(obj, protocol=5)
        pickle.loads(data)
    except Exception:
        return None
    return data


def _load(data: bytes | None) -> Any:
    if data is None:
        return None
    try:
        return pickle.loads(data)
    except Exception:
        return None


# The node of this process, for a child on a cluster (the Ray backend sets it); "" locally.
NODE = ""


def describe_process(role: str, worker_id: int | None = None) -> str:
    """Where an error was raised, in torch's words: ``worker process 0``, ``dispatching process``."""
    if role.startswith("dispatch"):
        name = "dispatching process"
    elif worker_id is None:
        name = role
    else:
        name = f"{role} process {worker_id}" if role == "worker" else f"{role} {worker_id}"
    return f"{name} (pid {os.getpid()}{', node ' + NODE if NODE else ''})"


def _innermost_datapipe(tb: TracebackType | None) -> str | None:
    found = None
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if isinstance(candidate, (IterDataPipe, MapDataPipe)):
            found = type(candidate).__name__
        tb = tb.tb_next
    return found
