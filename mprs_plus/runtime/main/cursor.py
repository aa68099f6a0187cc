"""How the main process reads one worker output (branch) from the N workers' channels.

    in order (default)   worker 0, 1, ..., N-1, 0, ... one item each; exhausted workers
                         are skipped. Deterministic: the same seed gives the same order.
    as ready             items as the workers produce them, a batch at a time: the first
                         channel with a message wins. Every item still arrives exactly
                         once; the order depends on timing. For imbalanced per-item costs.

Both read through the service's ``ChannelMux``, so a reader that waits also drops stale
messages from every other channel, and a newer epoch ends an older reader.

Items of a batch already read wait in the reader (``pending``) until their turn: pausing
the DataLoader2 suspends the reader between two items and loses none of them.

Each reader keeps a ``ReadCursor``: how many items of each worker it has handed out, whose
turn is next, and whether the epoch ended. It is updated just before an item is yielded,
so it counts what the user received, never what waits in ``pending``. It is the one count
of handed-out items: checkpoints read it per worker, the statistics read its total
(``MainReader.handed_out``), and a main segment with DataPipes of its own is counted by
one too, at its end (``restore.MainCounter``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..data_messages import Kind
from ..mux import ChannelMux


class ReadCursor:
    """What one reader has handed out this epoch (see the module docstring).

    ``consumed[w]`` items of worker w were yielded; ``next_worker`` is whose turn comes next
    (in order); ``ended`` once the epoch was read to its end. A restored epoch starts from
    the recorded counts and turn: an in-order reader begins at ``next_worker``.
    """

    __slots__ = ("consumed", "next_worker", "ended", "credits", "_restored")

    def __init__(
        self,
        workers: int,
        next_worker: int = 0,
        consumed: Sequence[int] = (),
        credits: Sequence[Callable[[], None]] | None = None,
    ) -> None:
        # A restored epoch counts on from what the user had before the checkpoint.
        self.consumed = list(consumed) if consumed else [0] * workers
        self.next_worker = next_worker
        self.ended = False
        # Per worker, called with each item handed out: its item window (``window.py``).
        self.credits = credits
        self._restored = sum(self.consumed)  # handed out before the checkpoint, by another process

    def handed(self) -> int:
        """Items this cursor's reader handed out itself, in this process."""
        return sum(self.consumed) - self._restored


# handed_on: a reader generator keeps no reference to an item it handed out. A generator
# suspended at ``yield item`` still holds ``item`` in its frame until the loop asks for the
# next one, so a batch the loop dropped (``del batch``) would stay alive: its shared memory
# lent, its GPU memory allocated, and at a stop its channel mapped in this process until
# the iterator goes (the pages then freed here, after the workers' exits, not by them).
# So the readers yield what a call returns (``queue.popleft()``, ``held.pop()``), never a local.


def read_in_order(
    mux: ChannelMux, channels: Sequence[int], epoch: int, cursor: ReadCursor | None = None
) -> Iterator[Any]:
    if cursor is None:
        cursor = ReadCursor(len(channels))
    consumed, credits = cursor.consumed, cursor.credits
    pending: list[deque[Any]] = [deque() for _ in channels]
    active = list(range(len(channels)))
    # A worker that ended before the restored position is dropped at its turn, as before.
    position = cursor.next_worker if cursor.next_worker < len(active) else 0
    take = mux.take
    while active:
        worker_id = active[position]
        queue = pending[worker_id]
        if queue:
            position = position + 1 if position + 1 < len(active) else 0
            consumed[worker_id] += 1
            cursor.next_worker = active[position]
            if credits is not None:
                credits[worker_id]()
            yield queue.popleft()  # held by no local while suspended (``handed_on``)
            continue
        message = take(channels[worker_id], epoch)
        if message is None:
            return  # a newer epoch began: this one was abandoned
        kind, _, payload = message
        if kind == Kind.ITEMS:
            queue.extend(payload)
            message = payload = None  # the queue holds the items now, and lets go of each as handed out
        elif kind == Kind.END:
            active.pop(position)
            if position >= len(active):
                position = 0
        else:
            raise payload.rebuild()
    cursor.ended = True


def read_as_ready(
    mux: ChannelMux, channels: Sequence[int], epoch: int, cursor: ReadCursor | None = None
) -> Iterator[Any]:
    if cursor is None:
        cursor = ReadCursor(len(channels))
    consumed, credits = cursor.consumed, cursor.credits
    worker_of = {channel: w for w, channel in enumerate(channels)}
    open_channels = list(channels)
    take_any = mux.take_any
    while open_channels:
        channel, message = take_any(open_channels, epoch)
        if message is None:
            return
        kind, _, payload = message
        if kind == Kind.ITEMS:
            worker_id = worker_of[channel]
            payload.reverse()  # handed out from its end: each item leaves the list as it goes
            while payload:
                consumed[worker_id] += 1
                if credits is not None:
                    credits[worker_id]()
                yield payload.pop()
        elif kind == Kind.END:
            open_channels.remove(channel)
        else:
            raise payload.rebuild()
    cursor.ended = True
