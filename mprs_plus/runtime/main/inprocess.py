"""The service without child processes (``num_workers=0``, or nothing to run in workers):
the whole graph in the calling process, as torchdata runs it, worker 0 of 1.

It has ``ServiceRuntime``'s surface (``service.py``), so the reading service calls either
the same way:

    start()                      the main segment: the graph after ``worker_init_fn``
    begin_epoch(seed_generator)  seed the graph; with ``worker_reset_fn``, return the new one
    pause() / resume()           pause() / resume() the graph's DataPipes
    limit(n, limit_fn)           limit_fn(graph, n)
    stats()                      empty: there is no process to report on
    stop()                       nothing to end; the state says stopped

Nothing here stops working after ``stop()``: the graph is the user's own DataPipes, and
iterating them on needs no service.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torchdata.dataloader2.graph import set_graph_random_seed
from torchdata.dataloader2.utils import WorkerInfo, process_init_fn

from ...options import Options
from ..pausing import pause_datapipes, resume_datapipes
from .cursor import ReadCursor
from .family import Figures
from .state import Lifecycle, State

if TYPE_CHECKING:
    from ...stats import Stats


class InProcessRuntime:
    in_processes = False  # a mid-epoch checkpoint replays the graph here, in its own order
    counts_handed_out = False  # no reader: the main segment is counted at its end (``restore.MainCounter``)

    def __init__(self, datapipe: Any, options: Options) -> None:
        self.options = options
        self.lifecycle = Lifecycle()
        self.figures = Figures()  # never watches anything: the statistics stay empty
        self._datapipe: Any = datapipe  # until start()
        self._main: Any = None

    def start(self) -> Any:
        self._main = process_init_fn(self._datapipe, WorkerInfo(1, 0), self.options.worker_init_fn)
        self._datapipe = None
        self.lifecycle.advance(State.RUNNING)
        return self._main

    def begin_epoch(
        self, seed_generator: Any, iter_reset_fn: Any = None, skips: Sequence[int] = (), next_worker: int = 0
    ) -> Any:
        """Seed the graph; returns the graph ``worker_reset_fn`` made of it, or None without
        one (the graph stays the same object). A restored epoch is replayed through
        ``MainCounter``: ``skips`` and ``next_worker`` are always empty here."""
        set_graph_random_seed(self._main, seed_generator)
        if self.options.worker_reset_fn is None:
            return None
        self._main = self.options.worker_reset_fn(self._main, WorkerInfo(1, 0), seed_generator)
        return self._main

    def worker_processes(self) -> list[Any]:
        return []  # no worker: everything runs in this process

    def read_cursor(self) -> ReadCursor | None:
        return None

    def pause(self, pause_fn: Any = None) -> None:
        pause_datapipes(self._main)

    def resume(self, resume_fn: Any = None) -> None:
        resume_datapipes(self._main)

    def limit(self, num_batches: int | None, limit_fn: Any) -> None:
        limit_fn(self._main, num_batches)

    def stats(self) -> Stats:
        return self.figures.snapshot()

    def note_span(self, kind: Any, start: float, end: float) -> None:
        """No processes, no timeline: nothing to note."""

    def stop(self) -> None:
        self.lifecycle.advance(State.STOPPED)
