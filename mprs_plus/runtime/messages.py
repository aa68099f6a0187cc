"""The message protocol between the main, dispatch and worker processes.

Every message is a tuple ``(kind, epoch, payload)``; tuples pickle fastest.

    main --control--> dispatch     RESET(epoch, (seed_generator, iter_reset_fn)) | STOP
    main --control--> worker w     RESET(epoch, (seed_generator, iter_reset_fn)) | STOP
    main --control--> any child    PAUSE(epoch, pause_fn | None) | RESUME(epoch, resume_fn | None)
                                   | LIMIT(epoch, (num_batches | None, limit_fn))
    dispatcher d --data--> worker w   ITEMS(epoch, [item, ...]) ... END(epoch) | ERROR(epoch, RemoteError)
    worker w, output k --data--> main ITEMS(epoch, [item, ...]) ... END(epoch) | ERROR(epoch, RemoteError)

There is one data channel per (dispatcher, worker) and per (worker, worker output), each
with exactly one writing thread; see ``lanes.py`` for why that keeps the service free of
deadlocks.

Items travel in batches (see ``batching.py``): a reader takes them one by one, so order and
round-robin are per item, whatever the batch sizes.

``epoch`` increases with every RESET, so a reader drops whatever a producer sent for an
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
    RESET = 1
    STOP = 2
    PAUSE = 3
    RESUME = 4
    LIMIT = 5
    ITEMS = 10
    END = 11
    ERROR = 12

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # Travel as a plain int: cheaper, and unpickling needs no import of this module
        # (which may already be torn down when a stop runs at interpreter exit).
        return int, (self.value,)


class RemoteTraceback(Exception):
    """Carries the traceback text of an exception raised in another process."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class RemoteError:
    """An exception captured in a child process, ready to be raised again in the main one."""

    pickled: bytes | None  # the exception itself, when it survives a pickle round trip
    type_name: str
    message: str
    traceback_text: str
    where: str  # "worker 1 (pid 4242)"
    datapipe: str | None  # the innermost DataPipe on the failing stack

    @classmethod
    def capture(cls, exc: BaseException, where: str) -> RemoteError:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        try:
            pickled: bytes | None = pickle.dumps(exc, protocol=5)
            pickle.loads(pickled)
        except Exception:
            pickled = None
        return cls(
            pickled=pickled,
            type_name=f"{type(exc).__module__}.{type(exc).__qualname__}",
            message=str(exc),
            traceback_text=text,
            where=where,
            datapipe=_innermost_datapipe(exc.__traceback__),
        )

    def context(self) -> str:
        by = f" by {self.datapipe}" if self.datapipe else ""
        return f"raised in {self.where}{by}"

    def rebuild(self) -> BaseException:
        """The original exception when it can be rebuilt, else ``WorkerError`` with its text."""
        exc: BaseException | None = None
        if self.pickled is not None:
            try:
                exc = pickle.loads(self.pickled)
            except Exception:
                exc = None
        if exc is None:
            exc = WorkerError(f"{self.type_name}: {self.message} ({self.context()})")
        else:
            exc.add_note(f"({self.context()})")
        exc.__cause__ = RemoteTraceback(f"\n\"\"\"\n{self.traceback_text}\"\"\"")
        return exc


def describe_process(role: str, worker_id: int | None = None) -> str:
    name = role if worker_id is None else f"{role} {worker_id}"
    return f"{name} (pid {os.getpid()})"


def _innermost_datapipe(tb: TracebackType | None) -> str | None:
    found = None
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if isinstance(candidate, (IterDataPipe, MapDataPipe)):
            found = type(candidate).__name__
        tb = tb.tb_next
    return found
