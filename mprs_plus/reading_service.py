"""Thin adapter to torchdata's ``ReadingServiceInterface``: every method hands over to a runtime.

    DataLoader2 --initialize(dp)--------> plan(dp) -> open_runtime: ServiceRuntime (child
                                          processes) or InProcessRuntime; runtime.start()
                --initialize_iteration--> runtime.begin_epoch: seed the main segment; RESET
                                          every child
                --_pause / _resume------> runtime.pause() / resume(): the main segment's
                                          DataPipes, then PAUSE / RESUME every child
                --_limit----------------> runtime.limit(): limit_fn to the children and the main segment
                --finalize--------------> runtime.stop()
                --checkpoint------------> bytes: the epoch as the user has seen it (runtime/main/restore.py)
                --restore(dp, bytes)----> initialize(dp); the next initialize_iteration resumes
"""

from __future__ import annotations

import contextlib
import time

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torchdata.dataloader2.reading_service import CheckpointableReadingServiceInterface

from .options import Options
from .plan import Plan, plan
from .runtime.main.family import Family
from .runtime.main.restore import Checkpoints
from .runtime.main.service import ServiceRuntime, open_runtime, warnings_for
from .runtime.main.stats import ServiceClock
from .runtime.timeline import Span
from .user_frame import warn

if TYPE_CHECKING:
    from .runtime.main.inprocess import InProcessRuntime
    from .stats import Stats


class MultiProcessingReadingService(CheckpointableReadingServiceInterface):
    """Run a DataPipe graph across a dispatch process, N worker processes and the main process.

    Same arguments and meaning as torchdata's ``MultiProcessingReadingService``. The graph
    is split where its markers say (``sharding_round_robin_dispatch``, non-replicable
    DataPipes, ``NoGraph``, ``get_parents()``); a graph that cannot be split as written
    raises ``AmbiguousGraphError`` instead of silently running in one process.

    Args:
        num_workers: worker processes; 0 runs everything in the calling process.
        multiprocessing_context: "fork", "spawn", "forkserver", or None for the default.
        worker_prefetch_cnt: items each worker may produce ahead of the main process.
        main_prefetch_cnt: items the main process may have waiting, spread over workers.
        worker_init_fn: ``fn(datapipe, WorkerInfo) -> datapipe``, once in each worker.
        worker_reset_fn: ``fn(datapipe, WorkerInfo, SeedGenerator) -> datapipe``, every
            epoch in each worker.

    Other Parameters:
        dispatch_init_fn: ``fn(datapipe, WorkerInfo) -> datapipe``, once in the dispatch
            process, on its copy of the dispatcher (``WorkerInfo(num_workers, 0)``).
        dispatch_buffer_size: items the dispatch process may deal ahead to each worker;
            None follows ``worker_prefetch_cnt``.
        in_order: True (default) yields items round-robin over the workers, reproducibly;
            False yields them as the workers produce them, which hides imbalanced per-item
            costs but makes the order depend on timing.
        timeout: seconds to wait for the next item before raising ``TimeoutError``;
            None waits as long as the workers are alive (a dead one is an error at once).
        collect_stats: keep live statistics for ``stats()`` (a few clock reads per item).
        stats_interval: seconds between two statistics summaries logged at INFO level
            on the ``mprs_plus.stats`` logger; None logs none.
        backend: where the worker and dispatch segments run: None for processes of this
            host; ``mprs_plus.RayBackend(...)`` for Ray actors on a cluster's nodes (the main
            segment stays in this process; items, order, seeds and checkpoints are the same).
        pin_memory: True page-locks every tensor of every item, as torch's DataLoader does:
            large ones where they lie (the lend areas are registered with CUDA), small ones
            copied into pinned memory, so ``.to("cuda", non_blocking=True)`` runs at the
            bus's speed. Without an accelerator: a warning, and items as they are.
        device: with ``pin_memory=True``, e.g. ``"cuda"``: items reach the loop already on
            that device, copied on the service's own stream ahead of the loop (the loop's
            current stream waits for each copy on the device).
        device_prefetch: items copied to ``device`` ahead of the loop (default 2).
        worker_restarts: dead worker processes replaced in the service's life, all workers
            together (default 0: a dead worker is an error). A replacement goes on where
            the dead one stopped: the same items in the same order (the documentation's
            page "When a worker dies").
            With a dispatch process, each dispatcher keeps the items it dealt in the
            current epoch, to deal them again to a replacement; its own death is an error.
        timeline: record a timeline of every process (what each was doing, when), for
            ``stats().write_timeline(path)``: True keeps the last 32768 spans of each
            process's lane, a number keeps that many; False (default) records nothing.
            Needs ``collect_stats``; local workers only (docs/profiling.md).

    The arguments under "Other parameters" go beyond torchdata's, and are keyword-only.

    A worker segment with several outputs (several branches joined in the main process)
    or several dispatchers hands its hooks a ``SegmentOutputs`` holding them.

    Checkpoints: ``DataLoader2.state_dict()`` mid-epoch and ``DataLoader2.from_state()`` /
    ``load_state_dict()`` in a new process go on exactly after the last item the user
    received (the same items in the same order with ``in_order=True``, the same set with
    ``in_order=False``), given a pipeline that is deterministic for its seed and the same
    ``num_workers``. See the checkpoint page of the documentation for the limits.
    """

    def __init__(
        self,
        num_workers: int = 0,
        multiprocessing_context: str | None = None,
        worker_prefetch_cnt: int = 10,
        main_prefetch_cnt: int = 10,
        worker_init_fn: Callable[..., Any] | None = None,
        worker_reset_fn: Callable[..., Any] | None = None,
        *,
        dispatch_init_fn: Callable[..., Any] | None = None,
        dispatch_buffer_size: int | None = None,
        in_order: bool = True,
        timeout: float | None = None,
        collect_stats: bool = True,
        stats_interval: float | None = None,
        backend: Any = None,
        pin_memory: bool = False,
        device: Any = None,
        device_prefetch: int = 2,
        worker_restarts: int = 0,
        timeline: bool | int = False,
    ) -> None:
        self.options = Options(
            num_workers=num_workers,
            multiprocessing_context=multiprocessing_context,
            worker_prefetch_cnt=worker_prefetch_cnt,
            main_prefetch_cnt=main_prefetch_cnt,
            worker_init_fn=worker_init_fn,
            worker_reset_fn=worker_reset_fn,
            dispatch_init_fn=dispatch_init_fn,
            dispatch_buffer_size=dispatch_buffer_size,
            in_order=in_order,
            timeout=timeout,
            collect_stats=collect_stats,
            stats_interval=stats_interval,
            backend=backend,
            pin_memory=pin_memory,
            device=device,
            device_prefetch=device_prefetch,
            worker_restarts=worker_restarts,
            timeline=timeline,
        )
        self._plan: Plan | None = None
        self._runtime: ServiceRuntime | InProcessRuntime | None = None
        self._feeding: Any = None
        self._family = Family.new()
        self._checkpoints = Checkpoints(num_workers, in_order)

    # torchdata's public attributes, with its names and values; read-only, because the
    # options are validated once and a running service could not follow a change anyway.

    @property
    def num_workers(self) -> int:
        return self.options.num_workers

    @property
    def multiprocessing_context(self) -> str | None:
        return self.options.multiprocessing_context

    @property
    def worker_prefetch_cnt(self) -> int:
        return self.options.worker_prefetch_cnt

    @property
    def main_prefetch_cnt(self) -> int:
        return self.options.main_prefetch_cnt

    @property
    def worker_init_fn(self) -> Callable[..., Any] | None:
        return self.options.worker_init_fn

    @property
    def worker_reset_fn(self) -> Callable[..., Any] | None:
        return self.options.worker_reset_fn

    @property
    def plan(self) -> Plan | None:
        """The plan this service runs, once ``DataLoader2`` has initialized it."""
        return self._plan

    def stats(self) -> Stats:
        """A snapshot of what every process has done since the service started (all epochs
        together): items in and out, time busy, waiting for input and handing items on,
        bytes moved, queue fill, where the main process's time went, and a sentence naming
        what limits throughput or saying that the pipeline keeps up (``stats().summary()``).
        Empty before the first epoch or without workers.

        ``DataLoader2`` runs a copy of the service it is given; the object you created
        reports that copy's statistics (the last one started, in this process), and after
        ``shutdown()`` the figures as they stood when it stopped.
        """
        return self._runtime.stats() if self._runtime is not None else self._family.stats()

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader2 copies the service before use; a running one is never copied. The copy
        # stays in the family of the original, so that the original can report its stats,
        # and starts with no checkpoint state of its own.
        return {"options": self.options, "family": self._family.token}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.options = state["options"]
        self._plan = None
        self._runtime = None
        self._feeding = None
        self._family = Family.joined(state["family"])
        self._checkpoints = Checkpoints(self.options.num_workers, self.options.in_order)

    def initialize(self, datapipe: Any) -> Any:
        self._plan = plan(datapipe, self.options.num_workers)
        self._checkpoints.planned(self._plan)  # a checkpoint names the graph it is about
        for message in warnings_for(self._plan, self.options):
            warn(message, UserWarning)  # at the user's line, not DataLoader2's
        self._feeding = _open_feeding(self.options)
        if self._feeding is not None:
            self._plan = self._plan._replace(delivery=self._feeding.delivery)
        self._runtime = open_runtime(datapipe, self._plan, self.options)
        with self._feeding.channels() if self._feeding is not None else contextlib.nullcontext():
            main = self._runtime.start()  # only a pinning service's channels are page-locked
        if isinstance(main, ServiceClock):
            main.profile_as_datapipe()  # each next() a profiler range, as under torchdata's service
        self._family.started(self._runtime.figures)
        if self._feeding is not None:
            self._runtime.figures.feeding = self._feeding.counters
        return self._adapt(main)

    def initialize_iteration(self, seed_generator: Any, iter_reset_fn: Any = None) -> Any:
        runtime = self._started("initialize_iteration")
        skips, next_worker = self._checkpoints.begin_epoch(seed_generator)  # a restored epoch: where to go on
        main = runtime.begin_epoch(seed_generator, iter_reset_fn, skips, next_worker)
        if main is None:
            return None  # the main segment DataLoader2 holds stays as it is
        adapted = self._adapt(main)
        return lambda _: adapted

    def _adapt(self, main: Any) -> Any:
        """What DataLoader2 iterates: the main segment, fed to the device if asked, counted
        for checkpoints where the user receives items (after any items copied ahead)."""
        counted = self._runtime is not None and self._runtime.counts_handed_out
        if self._feeding is not None:
            main = self._feeding.wrap(main)
            counted = counted and not self._feeding.ahead
        return self._checkpoints.adapt(main, counted)

    # -- checkpoint and restore: called by DataLoader2.state_dict() / from_state() ---------------

    def checkpoint(self) -> bytes:
        """The current epoch as the user has seen it: per worker, the items handed out (not
        those produced ahead), whose turn is next, and the epoch's seed generator.

        A main segment with DataPipes of its own (or ``num_workers=0``) is counted after it
        and replayed from the epoch start on restore; mid-epoch that needs ``in_order=True``
        (else ``ValueError``). Between epochs a checkpoint always works.
        """
        began = time.perf_counter()
        state = self._checkpoints.checkpoint(self._runtime)
        if self._runtime is not None:
            self._runtime.note_span(Span.SAVE, began, time.perf_counter())  # on the timeline, when recorded
        return state

    def restore(self, datapipe: Any, serialized_state: bytes) -> Any:
        """Start as ``initialize`` does; the next epoch goes on where the checkpoint was taken:
        each worker is re-seeded as at that epoch's start and drops, itself, the items the
        user already had. A checkpoint of another worker count is a ``ValueError``."""
        began = time.perf_counter()
        state = self._checkpoints.load(serialized_state)
        main = self.initialize(datapipe)
        try:
            self._checkpoints.arm(state)
        except ValueError:
            self.finalize()
            raise
        self._started("restore").note_span(Span.RESTORE, began, time.perf_counter())
        return main

    def finalize_iteration(self) -> None:
        return None

    def finalize(self) -> None:
        if self._runtime is not None:
            self._runtime.stop()
        feeding, self._feeding = self._feeding, None
        if feeding is not None:
            feeding.close()

    # -- pause, resume, limit: called by DataLoader2 (its iterator's limit() and resume()) --

    def _pause(self, pause_fn: Callable[[Any], Any] | None = None) -> None:
        """Stop producing: pause() the main segment's DataPipes (e.g. fullsync, prefetch),
        then ask every child to stop at its next item and run ``pause_fn`` on its segment.

        Nothing is lost: items already produced wait in the channels and in the main
        process's readers, in order, until ``_resume``.
        """
        self._started("_pause").pause(pause_fn)

    def _resume(self, resume_fn: Callable[[Any], Any] | None = None) -> None:
        self._started("_resume").resume(resume_fn)

    def _limit(self, num_batches: int | None, limit_fn: Callable[[Any, int | None], Any] | None = None) -> None:
        """With a ``limit_fn`` (from a reading service chained before this one), apply it in
        the children and to the main segment, as torchdata does; the count of items itself
        is kept by DataLoader2's iterator."""
        runtime = self._started("_limit")
        if limit_fn is not None:
            runtime.limit(num_batches, limit_fn)

    def _started(self, what: str) -> ServiceRuntime | InProcessRuntime:
        if self._runtime is None:
            raise RuntimeError(f"{what}() called before initialize(): use the service through DataLoader2")
        return self._runtime


def _open_feeding(options: Options) -> Any:
    if not options.pin_memory:
        return None  # the feeding module (and its device calls) only where asked for
    from .runtime.main.feeding import open_feeding

    return open_feeding(options.pin_memory, options.device, options.device_prefetch)
