"""Items bound for one channel travel in batches, and no item waits for a later one.

    owner thread:  add(item) ... add(item) --(full, or the reader sleeps)--> send ITEMS
    flusher thread (one per process): a batch whose first item is max_delay old --> send ITEMS

Small items share one message: that is what makes tiny items cheap. But a batch that is
only sent when the *next* item arrives holds finished items hostage to the next one: a
slow item (or one stuck for good) would hold back the ones before it, and a dispatcher
blocked writing to one worker would hold back the items it already dealt to another,
which can close a wait cycle with the main process (see ``service.py``). So:

* an item is handed on at once when the reader is asleep waiting for data (its flag is in
  the channel's shared memory) and no batch left in the last ``max_delay``: batching then
  only adds latency (while batches flow, a one-item message would only cost a wake-up);
* otherwise within ``max_delay`` of being produced, whatever the owner is doing: a
  per-process flusher thread sends a batch that has waited that long, with a send that
  never blocks (``timeout=0``), retrying later while the channel is full;
* the owner's own sends and the flusher's are serialised by the batch's lock, so the
  channel keeps one writer at a time and the items their order.

Large items are not batched: an item of ``LARGE_ITEM`` bytes or more (an array or a
tensor, or a tuple, list or dict holding one at its top level) is sent at once, with the
batch before it. Batching saves a per-message cost that is nothing beside such an item's
bytes, and a batch of them would make the reader unpickle, and hold, many at a time: the
transport lends a reader's user only so many bytes of shared memory (``transport/_lend.py``).

The flusher only ever sends the happy path. A batch that fails to pickle is left to the
owner, which sends the items before the culprit, then an ERROR naming it (which process,
which item, its type, the reason), and drops the rest of that epoch: the reader raises the
error instead of losing items silently.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections import deque
from typing import Any

from ...transport import ChannelError, Sender
from ..data_messages import Kind, RemoteError

_clock = time.perf_counter
# The items' kind as the plain int it travels as: the member itself is pickled through
# its __reduce_ex__ and a reference to builtins.int, 1.5 us of each message's 2.7.
_ITEMS = int(Kind.ITEMS)

# Seconds an item may wait in a batch for later ones before it is handed on, whatever the
# owner does (the module's rule).
HAND_ON = 0.002
LARGE_ITEM = 128 << 10  # bytes: the transport's smallest lent buffer (transport/_lend.py)
_SCALARS = frozenset((int, float, bool, str, type(None)))


def is_large(item: Any) -> bool:
    """``item`` is, or holds at its top level, an array or tensor of ``LARGE_ITEM`` bytes
    or more. Looks at ``nbytes`` only (numpy and torch both have it): no traversal, no
    pickling, so that small items pay next to nothing."""
    kind = type(item)
    if kind in _SCALARS:
        return False
    if kind is tuple or kind is list:
        return any(_large_leaf(value) for value in item[:8])
    if kind is dict:
        return any(_large_leaf(value) for _, value in zip(range(8), item.values()))
    return _large_leaf(item)


def _large_leaf(value: Any) -> bool:
    if type(value) in _SCALARS:
        return False
    nbytes = getattr(value, "nbytes", None)
    return isinstance(nbytes, int) and nbytes >= LARGE_ITEM


class Batcher:
    """Groups the items of one channel, as the module says.

    ``sender`` is the channel's transport sender; ``where`` names this process and ``to``
    the reader (for error messages). The owner also calls ``flush()`` before it could block
    on an input, and ``finish()`` at the end of an epoch.
    """

    __slots__ = (
        "_sender",
        "_epoch",
        "max_items",
        "max_delay",
        "_items",
        "_since",
        "_watched",
        "_sent_at",
        "_handed",
        "_failed_epoch",
        "_lock",
        "_reader_waiting",
        "_where",
        "_to",
    )

    def __init__(
        self,
        sender: Sender,
        epoch: int,
        max_items: int = 64,
        max_delay: float = HAND_ON,
        where: str = "a child process",
        to: str = "its reader",
    ) -> None:
        self._sender = sender
        self._epoch = epoch
        self.max_items = max_items
        self.max_delay = max_delay
        self._items: list[Any] = []
        self._since = 0.0
        self._watched = False  # the flusher will look at this batcher again (at most one look pending)
        self._sent_at = -1e9  # when the owner last sent a batch
        self._handed = 0  # items of this epoch already sent (numbers the culprit of an error)
        self._failed_epoch: int | None = None
        self._lock = threading.Lock()
        self._reader_waiting = sender.peer_waiting
        self._where = where
        self._to = to

    @property
    def sender(self) -> Sender:
        return self._sender

    @property
    def epoch(self) -> int:
        return self._epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        with self._lock:
            if epoch != self._epoch:
                self._epoch = epoch
                self._handed = 0

    def add(self, item: Any) -> None:
        with self._lock:
            items = self._items
            items.append(item)
            if is_large(item):
                pass  # sent at once, with what came before it (see the module's docstring)
            elif len(items) == 1:
                now = self._since = _clock()
                # At once to a reader asleep waiting for it, unless batches are flowing
                # (the last one left less than max_delay ago): then it gets a full batch
                # soon, and one-item messages would only cost both sides a wake-up each.
                if self.max_items > 1 and (now - self._sent_at < self.max_delay or not self._reader_waiting()):
                    if not self._watched:
                        self._watched = True
                        _flusher().watch(self, self._since + self.max_delay)
                    return
            elif len(items) < self.max_items and _clock() - self._since < self.max_delay:
                return
            self._send_items()

    def flush(self) -> None:
        with self._lock:
            self._send_items()

    def borrow(self, nbytes: int) -> Any | None:
        """The channel's ``Sender.borrow``, under the lock that keeps its one writer at a
        time (the flusher thread sends too): memory the next sends can carry uncopied."""
        with self._lock:
            return self._sender.borrow(nbytes)

    def finish(self, kind: Kind, payload: Any = None) -> None:
        """Flush, then send the epoch's last message (END or ERROR)."""
        with self._lock:
            self._send_items()
            if self._failed_epoch != self._epoch:
                self._sender.send((kind, self._epoch, payload))

    def send_aside(self, payload: Any) -> None:
        """Send the items held, then a RECORD of this epoch carrying ``payload``: a message
        for the main process's own use, rare (``generators.SentRecord``), never an item."""
        with self._lock:
            self._send_items()
            if self._failed_epoch != self._epoch:
                self._sender.send((Kind.RECORD, self._epoch, payload))

    def close(self) -> None:
        with self._lock:
            self._sender.close()

    # -- the owner's sends (lock held) ------------------------------------------------------

    def _send_items(self) -> None:
        items = self._items
        if not items:
            return
        self._items = []
        if self._failed_epoch == self._epoch:
            return  # the epoch ended in an ERROR: the rest of it is dropped
        try:
            self._sender.send((_ITEMS, self._epoch, items))
        except ChannelError:
            raise
        except BaseException as exc:  # an item's own pickling code may raise anything (SystemExit...)
            self._cannot_send(items, exc)
        else:
            self._handed += len(items)
            self._sent_at = _clock()

    def _cannot_send(self, items: list[Any], exc: BaseException) -> None:
        """Send the items before the one that does not pickle, then an ERROR about it."""
        self._failed_epoch = self._epoch
        culprit = _first_unpicklable(items)
        if culprit is None:
            reason: BaseException = exc
        else:
            if culprit:
                self._sender.send((_ITEMS, self._epoch, items[:culprit]))
            number = self._handed + culprit
            kind = type(items[culprit])
            text = (
                f"{self._where} failed while sending its item {number} of this epoch (counting from 0), "
                f"of type {kind.__module__}.{kind.__qualname__}, to {self._to}: "
                f"{type(exc).__name__}: {exc}"
            )
            reason = _same_kind(exc, text)
        self._sender.send((Kind.ERROR, self._epoch, RemoteError.capture(reason, self._where)))

    # -- the flusher's sends ----------------------------------------------------------------

    def _hand_on(self) -> float | None:
        """From the flusher: send the waiting batch if it is due, without ever blocking.
        None when there is nothing more to watch; else when to look again."""
        if not self._lock.acquire(blocking=False):
            return _clock() + self.max_delay  # the owner is adding or sending: look again soon
        try:
            items = self._items
            if items and self._failed_epoch != self._epoch:
                due = self._since + self.max_delay
                if due > _clock():
                    return due  # the batch seen before was sent; this newer one is not due yet
                try:
                    self._sender.send((_ITEMS, self._epoch, items), timeout=0)
                except TimeoutError:
                    return _clock() + self.max_delay  # full: the reader has items to read meanwhile
                except Exception:
                    pass  # a broken channel, or an item that does not pickle: the owner's business
                else:
                    self._items = []
                    self._handed += len(items)
            self._watched = False
            return None
        finally:
            self._lock.release()


def _first_unpicklable(items: list[Any]) -> int | None:
    for index, item in enumerate(items):
        try:
            pickle.dumps(item, protocol=5)
        except BaseException:
            return index
    return None


def _same_kind(exc: BaseException, text: str) -> BaseException:
    """An exception of ``exc``'s type saying ``text``, caused by ``exc``."""
    new: BaseException
    try:
        new = type(exc)(text)
        if str(new) != text:
            raise TypeError("unexpected constructor")
    except BaseException:
        new = RuntimeError(text)
    new.__cause__ = exc
    return new


class _Flusher:
    """One daemon thread per process that hands on batches whose first item is
    ``max_delay`` old. It sleeps on an event while no batch waits, and looks at a busy
    batcher at most once per ``max_delay``, so the owner's hot path pays nothing but an
    ``append`` now and then."""

    def __init__(self) -> None:
        # (when, batcher), in about that order: every batcher has the same delay, and at
        # most one entry here.
        self._due: deque[tuple[float, Batcher]] = deque()
        self._wake = threading.Event()
        self._idle = True
        threading.Thread(target=self._run, name="mprs_plus flusher", daemon=True).start()

    def watch(self, batcher: Batcher, at: float) -> None:
        self._due.append((at, batcher))
        if self._idle:
            self._wake.set()

    def _run(self) -> None:
        due = self._due
        while True:
            if not due:
                self._idle = True
                if not due:  # an append between the test above and this one set the event
                    self._wake.wait(1.0)  # set by watch(); the loop looks at `due` again either way
                self._wake.clear()
                self._idle = False
                continue
            at, batcher = due[0]
            now = _clock()
            if at > now:
                time.sleep(at - now)
            due.popleft()
            again = batcher._hand_on()
            if again is not None:
                due.append((again, batcher))


_the_flusher: _Flusher | None = None
_start_lock = threading.Lock()


def _flusher() -> _Flusher:
    flusher = _the_flusher
    if flusher is None:
        flusher = _start_flusher()
    return flusher


def _start_flusher() -> _Flusher:
    global _the_flusher
    with _start_lock:
        if _the_flusher is None:
            _the_flusher = _Flusher()
        return _the_flusher


def _forget_flusher() -> None:
    global _the_flusher, _start_lock
    _the_flusher = None  # its thread did not survive the fork
    _start_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_flusher)
