"""How far a worker lane may run ahead of what the main process handed out, counted in items.

    main process: the reader hands out item i of worker w --release--> [ permits of (w, k) ]
    worker w, lane k: one permit per item, taken before it is produced <-----------+

A channel bounds what a worker holds in messages, and a message carries up to 64 small
items (``child/batching.py``). torch's ``DataLoader`` promises more: at most
``prefetch_factor`` index batches of a worker are out beyond those the loop received. A
window gives that promise to any front end that asks (``Options.items_ahead``): a lane
produces an item only with a permit, the main process returns one per item it hands out
of that lane's channel, and a lane starts every epoch with ``size`` of them.

Who touches the count, and when:

* the main process only releases, one per item handed out, from its reading thread;
* the lane takes, before it produces; it waits only after flushing what it holds (every
  item it produced is then on its way to the main process, whose reads return permits),
  and re-checks every ``RECHECK`` seconds whether it was interrupted (a new epoch, a stop),
  so a wait never outlives the epoch it is for;
* the new epoch's count is set by the worker while it applies the epoch's reset, every
  lane of the process parked: the main process sends that reset after handing out the
  last item of the previous epoch, so no release of the old epoch comes after it.

Permits are a semaphore of this host (created before the children start, inherited or
passed at their start): a front end with workers on other hosts runs without a window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RECHECK = 0.1  # seconds a waiting lane sleeps before it looks whether it was interrupted


class ItemWindow:
    """The permits of one worker lane (see the module docstring)."""

    __slots__ = ("size", "_permits")

    def __init__(self, ctx: Any, size: int) -> None:
        if size < 1:
            raise ValueError(f"internal error: an item window of {size} items")
        self.size = size
        self._permits = ctx.Semaphore(size)

    def __getstate__(self) -> tuple[int, Any]:
        return (self.size, self._permits)

    def __setstate__(self, state: tuple[int, Any]) -> None:
        self.size, self._permits = state

    # -- main process ------------------------------------------------------------------

    def handed(self) -> None:
        """One item of this lane reached the main segment: the lane may produce one more."""
        self._permits.release()

    # -- the worker lane ---------------------------------------------------------------

    def reopen(self) -> None:
        """A new epoch: ``size`` permits, whatever the last one left (every lane parked)."""
        while self._permits.acquire(False):
            pass
        for _ in range(self.size):
            self._permits.release()

    def take(self, flush: Callable[[], None], interrupted: Callable[[], bool]) -> bool:
        """A permit for the next item; False if the lane was interrupted while waiting.
        ``flush`` sends what the lane holds before it waits."""
        permits = self._permits
        if permits.acquire(False):
            return True
        flush()
        while not interrupted():
            if permits.acquire(True, RECHECK):
                return True
        return False
