"""A reading service and the copies made of it in this process, so that the object a user
created reports the statistics of the copy that runs.

``DataLoader2`` runs a copy of the service it is given (pickled and unpickled). A copy
finds the original's family again through a token that names the process, so a copy made
in another process starts a family of its own. The family holds the statistics of the
copy started last (``Figures``, which keep neither the runtime nor its children alive),
never a runtime.
"""

from __future__ import annotations

import itertools
import os
import weakref
from typing import TYPE_CHECKING, Any, ClassVar

from ...user_frame import warn

from .stats import Readings

if TYPE_CHECKING:
    from ...stats import Stats
    from .stats import StatsView
    from .reader import MainReader


class Family:
    _registry: ClassVar[weakref.WeakValueDictionary[str, Family]] = weakref.WeakValueDictionary()
    _counter: ClassVar[itertools.count[int]] = itertools.count()

    def __init__(self, token: str) -> None:
        self.token = token
        self._figures: Figures | None = None  # of the copy started last: live, or as they stood at its stop
        self._replaced_before: list[Any] = []  # dead workers replaced by the runtimes started before it

    @classmethod
    def new(cls) -> Family:
        family = cls(f"{os.getpid()}:{next(cls._counter)}")
        cls._registry[family.token] = family
        return family

    @classmethod
    def joined(cls, token: str) -> Family:
        return cls._registry.get(token) or cls.new()

    def started(self, figures: Figures, *, same_budget: bool = False) -> None:
        """``figures``: those of the copy starting now. ``same_budget``: its budget of
        replacements is the one of the runtimes before it (a ``DataLoader``'s epochs), so
        its ``stats()`` list theirs too."""
        self._replaced_before = self._replacements() if same_budget else []
        self._figures = figures

    def replacements_made(self) -> int:
        """Dead workers replaced by every runtime of this family so far: a loader's
        ``worker_restarts`` budget is its life's, whether its workers persist or not."""
        return len(self._replacements())

    def stats(self) -> Stats:
        """The figures of the copy started last, but ``replacements``: those of the
        loader's life, as its budget counts them (an epoch without persistent workers runs
        a runtime of its own, which would forget the workers replaced before it)."""
        stats = self._figures.snapshot() if self._figures is not None else _empty()
        return _with_replacements(stats, self._replacements())

    def _replacements(self) -> list[Any]:
        current = self._figures.replacements if self._figures is not None else []
        return [*self._replaced_before, *current]


class Figures:
    """One runtime's statistics: live while it runs, as they stood once its stop began.

    Holds the statistics view and the reader (whose cursors count the items handed out),
    never the runtime, and lets go of both when it freezes: a ``Family`` may keep it after
    the runtime is gone."""

    def __init__(self) -> None:
        self._view: StatsView | None = None
        self._reader: MainReader | None = None
        self._final: Stats | Readings | None = None  # Readings: frozen, the report not built yet
        self.feeding: Any = None  # the feeding's counters (``feeding.py``), when items are pinned
        self.replacements: list[Any] = []  # dead workers replaced (``replacement.py``), in order
        self._memory_warned = False

    def watch(self, view: StatsView | None, reader: MainReader) -> None:
        self._view, self._reader = view, reader

    def snapshot(self) -> Stats:
        view, reader, final = self._view, self._reader, self._final  # a stop may freeze meanwhile
        if final is not None:
            if not isinstance(final, Readings):
                return final
            self._final = final = self._report(final.build())  # built once, when first asked for
            return final
        if view is None or reader is None:
            return self._report(_empty())
        return self._report(self._read(view, reader).build())

    def _read(self, view: StatsView, reader: MainReader) -> Readings:
        view.main.items_in = reader.handed_out()
        return view.read(epochs=reader.epoch)

    def _report(self, stats: Stats) -> Stats:
        return _with_replacements(_with_feeding(stats, self.feeding), self.replacements)

    def check_memory(self) -> None:
        """At an epoch's end (and the next one's start): warn once, at the user's line, when
        the workers copy what they share with the main process (``mprs_plus.stats.copying``)."""
        if self._memory_warned or self._view is None:
            return
        memory = self.snapshot().memory
        if memory:
            self._memory_warned = True
            warn(memory[0].upper() + memory[1:], RuntimeWarning)

    def freeze(self) -> None:
        """What stats() reads from the stop on, read in the stop while the main ends are
        open; made into the report when first asked for (a stop does not load its types)."""
        if self._final is None:
            view, reader = self._view, self._reader
            self._final = self._read(view, reader) if view is not None and reader is not None else self.snapshot()
            self._view = self._reader = None


def _with_feeding(stats: Stats, counters: Any) -> Stats:
    if counters is None:
        return stats
    from dataclasses import asdict, replace

    from ...stats import DeviceFeed

    return replace(stats, device=DeviceFeed(**asdict(counters)))


def _with_replacements(stats: Stats, made: list[Any]) -> Stats:
    if not made:
        return stats
    from dataclasses import replace

    return replace(stats, replacements=tuple(made))


def _empty() -> Stats:
    from ...stats import aggregate  # the report types load when statistics are asked for

    return aggregate([])
