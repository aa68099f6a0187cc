"""The data protocol between the dispatch, worker and main processes (control messages,
main -> each child, are typed: ``control_messages.py``).

Every data message is a tuple ``(kind, epoch, payload)``; tuples pickle fastest.

    dispatcher d --data--> worker w   ITEMS(epoch, [item, ...]) ... END(epoch) | ERROR(epoch, RemoteError)
    worker w, output k --data--> main ITEMS(epoch, [item, ...]) ... END(epoch) | ERROR(epoch, RemoteError)
                                      RECORD(epoch, (position, generator states)) in between, from a
                                      Ray actor whose dead workers are replaced (``generators.py``)

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
from types import GetSetDescriptorType, MemberDescriptorType, TracebackType
from typing import Any, NamedTuple

from torch.utils.data import IterDataPipe, MapDataPipe

from ..errors import WorkerError
from ..segment import Segment


class Kind(enum.IntEnum):
    ITEMS = 10
    END = 11
    ERROR = 12
    # A worker's generator states at a position of its stream, for a replacement
    # (``generators.SentRecord``); read aside by the main process, never handed to a reader.
    RECORD = 13

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # Travel as a plain int: cheaper, and unpickling needs no import of this module
        # (which may already be torn down when a stop runs at interpreter exit).
        return int, (self.value,)




class RemoteError(NamedTuple):
    """An exception captured in a child process, ready to be raised again in the main one.

    Raised the way torch's DataLoader and torchdata raise a worker's exception, so code
    that reads ``str(exc)`` works unchanged: the same type, built from one message

        Caught ValueError in worker process 0 (pid 4242).
        Original Traceback (most recent call last):
          ...
        ValueError: bad sample 5

    The type travels on its own (pickled by reference), so it survives even when the
    exception's other attributes cannot be pickled. Its fields travel one by one too: the
    instance's attributes (``returncode``, a custom ``code``) and the fields built-in types
    keep outside it (``errno``, ``filename``, a Unicode error's ``encoding``), so that one
    that does not pickle loses only itself, and a field torch's DataPipe hooks garbled
    through ``args`` reads as raised.

    A named tuple (immutable, made at import without generated code, which the first item
    of every loader waits for), as the control messages are.
    """

    type_pickled: bytes | None  # the exception's class, when main can import it
    pickled: bytes | None  # the exception itself, when it survives a pickle round trip
    type_name: str
    message: str
    traceback_text: str
    where: str  # "worker process 1 (pid 4242)"
    datapipe: str | None  # the innermost DataPipe on the failing stack
    fields: tuple[tuple[str, bytes], ...] = ()  # (name, pickled value) of each field that pickles
    args_pickled: bytes | None = None  # ``exc.args``, for a type rebuilt without its constructor

    @classmethod
    def capture(cls, exc: BaseException, where: str) -> RemoteError:
        """Never raises: a capture that failed would end the child instead of reporting."""
        passed_on = getattr(exc, _ORIGIN, None)
        if isinstance(passed_on, RemoteError):
            # Raised again as it arrived (a dispatch error in a worker): it still names
            # the process where it happened, not the one that passes it on.
            return passed_on
        message = _safe_str(exc)
        try:
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        except Exception:
            text = f"Traceback (most recent call last):\n  (unavailable)\n{type(exc).__name__}: {message}\n"
        try:
            datapipe = _innermost_datapipe(exc.__traceback__)
        except Exception:
            datapipe = None
        return cls(
            type_pickled=_round_trip(type(exc)),
            pickled=_round_trip(exc),
            type_name=type(exc).__name__,
            message=message,
            traceback_text=text,
            where=where,
            datapipe=datapipe,
            fields=_fields_of(exc),
            args_pickled=_round_trip(getattr(exc, "args", ())),
        )

    def context(self) -> str:
        by = f" by {self.datapipe}" if self.datapipe else ""
        return f"raised in {self.where}{by}"

    def text(self) -> str:
        """torch's wording: which type, where, then the original traceback."""
        return f"Caught {self.type_name} in {self.where}.\nOriginal {self.traceback_text.rstrip()}"

    def rebuild(self) -> BaseException:
        """The original type with its fields, its ``str()`` being ``text()`` as torch does.

        Tried in order: the type built from ``text()`` (torch's way); the original
        exception object (its constructor does not take one message); the type made
        without its constructor, its ``args`` and fields set back (the original no longer
        pickles, say because a DataPipe hook rewrote its ``args``). Whichever it is, its
        fields are set back as raised; when they, not ``text()``, make its ``str()`` (an
        ``OSError``'s errno and filename) or it has no usable ``str()``, ``text()`` is its
        first note.

        ``WorkerError`` carrying ``text()`` stands in when the main process cannot import
        the type, or when it is not an ``Exception``: ``SystemExit``, ``KeyboardInterrupt``
        or ``GeneratorExit`` raised by a worker's code would mean something else here (the
        end of the training process, a Ctrl-C, a generator being closed).
        """
        text = self.text()
        kind = _load(self.type_pickled)
        exc: BaseException | None = None
        if isinstance(kind, type) and issubclass(kind, Exception):
            for build in (self._from_text, self._original, self._bare):
                exc = build(kind, text)
                if exc is not None:
                    break
        if exc is None:
            exc = WorkerError(text)
        elif _safe_str(exc) != text:
            exc.add_note(text)
        exc.add_note(f"({self.context()})")
        try:
            setattr(exc, _ORIGIN, self)
        except Exception:  # no instance dict: it would be wrapped again if passed on
            pass
        return exc

    def _from_text(self, kind: type[BaseException], text: str) -> BaseException | None:
        try:
            # KeyError's str() is the repr of its argument: keep the text readable.
            exc = kind(_VerbatimText(text) if issubclass(kind, KeyError) else text)
        except Exception:
            return None
        return exc if self._set_fields(exc) else None

    def _original(self, kind: type[BaseException], text: str) -> BaseException | None:
        exc = _load(self.pickled)
        if not isinstance(exc, kind):
            return None
        return exc if self._set_fields(exc) else None

    def _bare(self, kind: type[BaseException], text: str) -> BaseException | None:
        args = _load(self.args_pickled)
        try:
            exc = kind.__new__(kind, *args) if isinstance(args, tuple) else kind.__new__(kind)
            if isinstance(args, tuple):
                exc.args = args
        except Exception:
            return None
        return exc if isinstance(exc, kind) and self._set_fields(exc) else None

    def _set_fields(self, exc: BaseException) -> bool:
        """Set the captured fields on ``exc``; False when its type refuses them."""
        try:
            for name, data in self.fields:
                value = _load(data, _MISSING)
                if value is not _MISSING:
                    setattr(exc, name, value)
        except Exception:
            return False
        return True


_ORIGIN = "_mprs_plus_remote_error"  # on a rebuilt exception: where it came from
_MISSING = object()
# Fields of BaseException itself (or ours) that are not the exception's own data.
_NOT_FIELDS = frozenset(
    ("args", "__traceback__", "__context__", "__cause__", "__suppress_context__", "__dict__", "__notes__", _ORIGIN)
)


def _fields_of(exc: BaseException) -> tuple[tuple[str, bytes], ...]:
    """Every field of ``exc`` that pickles: instance attributes, and the fields built-in
    exception types keep in C (``errno``, ``strerror``, ``filename``; ``encoding``,
    ``object``, ``start``, ``end``, ``reason``; ``code``; ``value``; ...)."""
    builtin: list[str] = []
    try:
        for cls in type(exc).__mro__:
            if cls.__module__ != "builtins" or not issubclass(cls, BaseException):
                continue
            for name, attribute in vars(cls).items():
                if isinstance(attribute, (MemberDescriptorType, GetSetDescriptorType)) and name not in _NOT_FIELDS:
                    builtin.append(name)
        own = [name for name in getattr(exc, "__dict__", {}) if name not in _NOT_FIELDS]
    except Exception:
        return ()
    fields = []
    for name in dict.fromkeys(builtin + own):
        try:
            value = getattr(exc, name)
        except Exception:  # a field that is not set (OSError.characters_written)
            continue
        if value is None and name not in own:
            continue  # a built-in field left unset: setting None would change str() (OSError.filename2)
        data = _round_trip(value)
        if data is not None:
            fields.append((name, data))
    return tuple(fields)


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return "<exception str() failed>"


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


def _load(data: bytes | None, missing: Any = None) -> Any:
    if data is None:
        return missing
    try:
        return pickle.loads(data)
    except Exception:
        return missing


# The node of this process, for a child on a cluster (the Ray backend sets it); "" locally.
NODE = ""


def describe_process(role: Segment, worker_id: int = 0) -> str:
    """Where an error was raised, in torch's words: ``worker process 0``, ``dispatching process``."""
    if role is Segment.DISPATCH:
        name = "dispatching process"
    elif role is Segment.WORKER:
        name = f"worker process {worker_id}"
    else:
        name = "main process"
    return f"{name} (pid {os.getpid()}{', node ' + NODE if NODE else ''})"


def _innermost_datapipe(tb: TracebackType | None) -> str | None:
    found = None
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if isinstance(candidate, (IterDataPipe, MapDataPipe)):
            found = type(candidate).__name__
        tb = tb.tb_next
    return found
