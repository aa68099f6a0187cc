"""A dispatch lane that can deal a replaced worker its epoch again (``worker_restarts``).

    dispatcher d --item--> log[w] (every item of the epoch, in order) --live--> channel (d, w)
                                                                      --held--> nothing yet
    main: worker w died --> Redeal(w, new sending ends) --> listener thread --> redealer thread
                             redealer: log[w] from its start --> new channel, then live again

A worker fed by dispatchers consumed items it had not turned into outputs when it died;
they die with it, and what its end of the channel had read is unknown. Its replacement
replays its segment from the epoch's start (``Reset.skip``: what the loop already has), so
it needs every item it was dealt this epoch again, in the same order. The log is the truth;
a channel only carries a copy of it. The cost: the items a dispatcher dealt in the
current epoch stay referenced until the next epoch begins (file names or shard ids are
cheap; decoded samples dealt by a dispatcher are not: docs/worker-restarts.md).

Per worker the lane is *live* (``_live[w]`` is its batcher: items go to the log and to
the channel) or *held* (``_live[w]`` is None: items go to the log only):

* a send that finds the channel broken (its reader died) makes it held; the lane never
  ends for it, and never waits on it again;
* ``redeal(w, sender)``, from the listener thread as the message arrives, makes it held at
  once (the lane may be blocked on another worker's full channel: nothing waits for it to
  park) and starts a redealer thread, the only writer of the new channel until it is live;
* the redealer copies ``log[w]`` in chunks, then the epoch's END or ERROR once the lane
  recorded it, and makes the worker live again with its batcher when nothing is left to copy.

``_guard`` orders the log, ``_live``, ``_ends`` and the epoch between the lane thread and a
redealer: every append, every switch between live and held, and every look at what is left
to copy happen under it, so that an item reaches the new channel exactly once, after
the ones before it. Nobody sends under it, and nobody takes it while holding a batcher's
lock (which a send holds). A new epoch (``set_epoch``, lane 0 with the lanes parked) clears
the logs; a redealer sees the change and starts again from the new epoch's log (what it
sent of the old one is stale there and dropped by the worker). A redealer whose channel
breaks in turn (the replacement died too) ends: the next replacement has its own.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from ...transport import ChannelError, Sender
from ..data_messages import Kind, RemoteError
from .batching import Batcher
from .lanes import DealLane


class LoggedDealLane(DealLane):
    """A ``DealLane`` that keeps what it dealt each worker this epoch (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Takes ``DealLane``'s arguments."""
        super().__init__(*args, **kwargs)
        count = self._count
        self._guard = threading.Lock()
        self._logs: list[list[Any]] = [[] for _ in range(count)]
        self._ends: list[tuple[Kind, Any] | None] = [None] * count  # the epoch's last message, once made
        self._live: list[Batcher | None] = list(self._batchers)
        self._redeals = [0] * count  # per worker, the latest redeal: an older redealer stops
        self._epoch = 0
        self._closed = False

    def set_epoch(self, epoch: int) -> None:
        with self._guard:
            self._epoch = epoch
            self._logs = [[] for _ in range(self._count)]
            self._ends = [None] * self._count
            for batcher in self._live:
                if batcher is not None:
                    batcher.epoch = epoch
        self._turn = 0

    def emit(self, item: Any) -> None:
        turn = self._turn
        self._turn = turn + 1 if turn + 1 < self._count else 0
        with self._guard:
            self._logs[turn].append(item)
            batcher = self._live[turn]
        if batcher is not None:
            try:
                batcher.add(item)
            except ChannelError:
                self._lost(turn, batcher)

    def finish(self) -> None:
        self._end([(Kind.END, None)] * self._count)

    def fail(self, error: RemoteError) -> None:
        """The error takes the failing item's place in the deal; the other workers end."""
        ends: list[tuple[Kind, Any]] = [(Kind.END, None)] * self._count
        ends[self._turn] = (Kind.ERROR, error)
        self._end(ends)

    def flush(self) -> None:
        with self._guard:
            live = list(self._live)
        for w, batcher in enumerate(live):
            if batcher is not None:
                try:
                    batcher.flush()
                except ChannelError:
                    self._lost(w, batcher)

    def close(self) -> None:
        with self._guard:
            self._closed = True
            live, self._live = self._live, [None] * self._count
        for batcher in live:
            if batcher is not None:
                with contextlib.suppress(ChannelError):
                    batcher.close()

    def redeal(self, worker: int, sender: Sender) -> None:
        """Worker ``worker`` was replaced; ``sender`` writes to its replacement. Returns at
        once (the listener thread calls it); a redealer thread does the copying."""
        batcher = Batcher(sender, 0, max_items=self._max_items, where=self._where, to=f"worker {worker}")
        with self._guard:
            if self._closed:
                batcher.close()
                return
            old, self._live[worker] = self._live[worker], None
            self._redeals[worker] += 1
            generation = self._redeals[worker]
        threading.Thread(
            target=self._redeal, args=(worker, batcher, generation, old), name=f"mprs_plus redeal {worker}", daemon=True
        ).start()

    # -- internals -------------------------------------------------------------------------

    def _end(self, ends: list[tuple[Kind, Any]]) -> None:
        with self._guard:
            self._ends = ends
            live = list(self._live)
        for w, batcher in enumerate(live):
            if batcher is not None:
                try:
                    batcher.finish(*ends[w])
                except ChannelError:
                    self._lost(w, batcher)

    def _lost(self, worker: int, batcher: Batcher) -> None:
        """``batcher``'s channel broke: its worker died. Held from now on (if it is still
        the live one), until a redeal."""
        with self._guard:
            if self._live[worker] is batcher:
                self._live[worker] = None
        with contextlib.suppress(Exception):
            batcher.close()

    def _redeal(self, worker: int, batcher: Batcher, generation: int, old: Batcher | None) -> None:
        if old is not None:  # the dead worker's: the lane may still be inside one of its sends
            with contextlib.suppress(Exception):
                old.close()
        epoch, sent, end_sent, went_live = None, 0, False, False
        try:
            while True:
                with self._guard:
                    if self._closed or self._redeals[worker] != generation:
                        return
                    if self._epoch != epoch:
                        epoch, sent, end_sent = self._epoch, 0, False
                        batcher.epoch = epoch
                    chunk = self._logs[worker][sent : sent + self._max_items]
                    end = self._ends[worker] if not chunk and not end_sent else None
                    if not chunk and end is None:
                        self._live[worker] = batcher
                        went_live = True
                        if self.stats is not None:
                            self.stats.channels = (*self.stats.channels, batcher.sender)
                        return
                if chunk:
                    for item in chunk:
                        batcher.add(item)
                    sent += len(chunk)
                elif end is not None:
                    batcher.finish(*end)
                    end_sent = True
        except ChannelError:
            return  # the replacement died too: the next one gets a redeal of its own
        finally:
            if not went_live:
                with contextlib.suppress(Exception):
                    batcher.close()
