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
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any


class Liveness:
    """The shared slots, made by the main process before its children start."""

    def __init__(self, ctx: Any, slots: int) -> None:
        self._since = ctx.RawArray("d", max(1, slots))

    def lane(self, slot: int) -> LaneLiveness:
        """What the lane of ``slot`` writes through (handed to its child in its setup)."""
        return LaneLiveness(self._since, slot)

    def asleep_for(self, slots: Iterable[int], seconds: float) -> bool:
        """Whether every lane of ``slots`` has slept in one channel wait for at least
        ``seconds``, without waking: then none of them can write or read anything that
        would wake another, and only the main process could."""
        since = [self._since[slot] for slot in slots]
        latest = time.monotonic() - seconds
        return bool(since) and all(0.0 < t <= latest for t in since)


class LaneLiveness:
    """One lane's slot: ``note(since)`` is the transport's ``note_blocking`` callback."""

    __slots__ = ("_since", "_slot")

    def __init__(self, since: Any, slot: int) -> None:
        self._since = since
        self._slot = slot

    def __getstate__(self) -> tuple[Any, int]:
        return (self._since, self._slot)

    def __setstate__(self, state: tuple[Any, int]) -> None:
        self._since, self._slot = state

    def note(self, since: float) -> None:
        self._since[self._slot] = since
