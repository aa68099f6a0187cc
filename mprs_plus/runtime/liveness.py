"""Whether each lane of the children sleeps in a channel wait: the evidence that tells a
read that can never end from a slow one (``main/reader.py``).

    lane of a child --note_blocking--> [ one float per lane, shared ] <--asleep_for-- main process
                                         since when it sleeps; 0.0 while awake

Always kept, whatever the statistics options: a starved in-order read must be an error
even when statistics are off (they are optional, for speed; this is not). Its cost is two
stores per sleep of a lane, none per item: the transport reports a sleep only once a wait
blocks, after its spin (``transport.note_blocking``).

Each lane is the only writer of its slot (one thread), and the main process only reads,
so no lock is needed: a stale read says "awake" or "asleep since a moment ago", and the
main process looks again at its next slice. Slots are numbered as the topology numbers
lanes (``ChildLink.stats_rows``).

While dead workers are replaced (``main/replacement.py``), each lane also says which item
of its epoch it is making: one store into a shared integer as it begins an item, read by
the main process once the lane's process died. A poison sample is then known at its
first death, whatever items the dead worker made and had not sent yet.

    lane of a worker, as it begins an item --> [ epoch << 32 | items begun, per lane ] <--making-- main
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any


class Liveness:
    """The shared slots, made by the main process before its children start."""

    def __init__(self, ctx: Any, slots: int, positions: bool = False) -> None:
        self._since = ctx.RawArray("d", max(1, slots))
        # Which item each lane is making, kept only while dead workers are replaced.
        self._begun = ctx.RawArray("q", max(1, slots)) if positions else None

    def lane(self, slot: int) -> LaneLiveness:
        """What the lane of ``slot`` writes through (handed to its child in its setup)."""
        return LaneLiveness(self._since, slot, self._begun)

    def asleep_for(self, slots: Iterable[int], seconds: float) -> bool:
        """Whether every lane of ``slots`` has slept in one channel wait for at least
        ``seconds``, without waking: then none of them can write or read anything that
        would wake another, and only the main process could."""
        since = [self._since[slot] for slot in slots]
        latest = time.monotonic() - seconds
        return bool(since) and all(0.0 < t <= latest for t in since)


class LaneLiveness:
    """One lane's slot: ``note(since)`` is the transport's ``note_blocking`` callback;
    ``begun`` (None unless positions are kept) the shared integers the lane's loop counts
    the items it begins in, at index ``slot``."""

    __slots__ = ("_since", "slot", "begun", "value")

    def __init__(self, since: Any, slot: int, begun: Any = None) -> None:
        self._since = since
        self.slot = slot
        self.begun = begun
        self.value = 0  # the lane's own copy of what it last stored in ``begun[slot]``

    def __getstate__(self) -> tuple[Any, int, Any]:
        return (self._since, self.slot, self.begun)

    def __setstate__(self, state: tuple[Any, int, Any]) -> None:
        self._since, self.slot, self.begun = state
        self.value = 0

    def note(self, since: float) -> None:
        self._since[self.slot] = since

    # -- which item the lane is making (kept while dead workers are replaced) --------------

    def begin_stream(self, epoch: int, first: int) -> None:
        """The lane's stream of ``epoch`` starts at item ``first`` (a restore skips the
        items before it without making them); the lane's loop adds one as it begins each item."""
        if self.begun is not None:
            self.value = self.begun[self.slot] = (epoch << _EPOCH_SHIFT) | first

    def making(self, epoch: int) -> int | None:
        """Main process, once the lane's process is dead: the position of the item it was
        making (or had made last) in ``epoch``, or None if it began none in that epoch."""
        if self.begun is None:
            return None
        value = self.begun[self.slot]
        if value < 0 or value >> _EPOCH_SHIFT != epoch or not value & _ITEMS:
            return None
        return (value & _ITEMS) - 1

    def forget(self) -> None:
        """Main process, before a replacement starts on this slot: nothing begun yet (a
        replacement that dies before its stream starts must not read as its predecessor)."""
        if self.begun is not None:
            self.begun[self.slot] = -1


_EPOCH_SHIFT = 32
_ITEMS = (1 << _EPOCH_SHIFT) - 1
