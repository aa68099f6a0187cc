"""``mprs_plus.DataLoader``: torch's ``DataLoader`` API, run by the service's runtime.

    DataLoader.__iter__ --> draw the epoch in this process, as torch does (epochs.py)
                        --> num_workers=0: fetch and collate here, lazily, as torch does
                        --> else: the plan of one DataPipe, LoaderStage (stage.py), replicated
                            in every worker; the runtime (ServiceRuntime) runs it:
                            begin_epoch(no seed generator, each worker's WorkerEpoch: its
                            round-robin share of the index batches), then reads the workers
                            round-robin (in_order) or as ready
    state_dict()        --> what drew the epoch + the runtime's read cursor (state.py)
    errors              --> torch's types and wording (errors.py)

Persistent workers keep one runtime for the loader's life; otherwise every epoch starts
its own, and stops it when the epoch ends or its iterator is dropped, as torch does.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader as _TorchDataLoader
from torch.utils.data.dataloader import _DatasetKind, _get_distributed_settings

from . import state as loader_state
from .epochs import EpochStart, capture_start, deal, draw_epoch, set_start
from .errors import is_fatal, torch_error
from .stage import EpochOrders, LoaderStage, WithState, WorkerEpoch, _Job, dataset_state, has_state, make_fetcher, replay


class DataLoader(_TorchDataLoader):
    """torch's ``DataLoader``, with the same arguments, defaults, attributes and batches,
    run by mprs_plus's workers; plus ``StatefulDataLoader``'s ``state_dict()`` and
    ``load_state_dict()``, exact at any batch.

    Beyond torch's arguments (keyword only):
        snapshot_every_n_steps: an iterable dataset with ``state_dict()`` has its state
            taken in each worker every n batches (``StatefulDataLoader``'s argument); a
            restore replays at most n - 1 batches of a worker. Map-style datasets need none.
        device: with ``pin_memory=True``, e.g. ``"cuda"``: batches reach the loop already
            on that device, copied on the service's own stream ahead of the loop.
        backend: where the workers run: None for processes of this host,
            ``mprs_plus.RayBackend(...)`` for Ray actors (the same batches).
        collect_stats: keep live statistics for ``stats()``.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Any = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Any = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        snapshot_every_n_steps: int = 1,
        device: Any = None,
        backend: Any = None,
        collect_stats: bool = True,
    ) -> None:
        super().__init__(
            dataset,
            batch_size,
            shuffle,
            sampler,
            batch_sampler,
            num_workers,
            collate_fn,
            pin_memory,
            drop_last,
            timeout,
            worker_init_fn,
            multiprocessing_context,
            generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        if isinstance(snapshot_every_n_steps, bool) or not isinstance(snapshot_every_n_steps, int) or snapshot_every_n_steps < 0:
            raise ValueError(
                f"snapshot_every_n_steps must be an int >= 0 (0: only at a worker's end), got {snapshot_every_n_steps!r}"
            )
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self.device = device
        self.backend = backend
        self.collect_stats = collect_stats
        self._options()  # checked now, as torch checks its own arguments
        self._run: _Run | None = None  # persistent workers: the runtime kept across epochs
        self._current: weakref.ref[_LoaderIterator] | None = None
        self._restore: dict[str, Any] | None = None  # load_state_dict(): for the next __iter__
        self._base_seed: int | None = None  # persistent workers: drawn with their first epoch
        # Persistent workers: each worker's dataset state as its last epoch left it (a
        # dataset with state_dict()), which a state taken between epochs carries.
        self._carry: dict[int, tuple[int, Any]] = {}
        from ..runtime.main.family import Family

        self._family = Family.new()

    # -- iterating ---------------------------------------------------------------------

    def __iter__(self) -> _LoaderIterator:  # type: ignore[override]
        restore, self._restore = self._restore, None
        persistent = self.persistent_workers and self.num_workers > 0
        carried, send = dict(self._carry) if persistent else {}, False
        if restore is not None:
            # What drew the recorded epoch (or, between epochs, what the next one draws
            # from), set back: the draws below repeat the uninterrupted run's.
            start = EpochStart.from_dict(restore["start"])
            set_start(self, start)
            if persistent:
                self._base_seed = None if start.draws_base_seed else start.base_seed
            if restore["phase"] != loader_state.RUNNING:
                # Nothing of the epoch was handed out: it begins as any other, its workers
                # loading the dataset states the recorded ones carried.
                carried, send, restore = dict(restore["worker_states"]), True, None
        else:
            start = capture_start(self, self._base_seed, not (persistent and self._base_seed is not None))
        base_seed, shared_seed, indices = draw_epoch(self, start)
        start = start._replace(base_seed=base_seed)
        if persistent:
            self._base_seed = base_seed
        previous = self._current() if self._current is not None else None
        if previous is not None and persistent:
            previous._abandon()  # its epoch ends: the workers move on to this one, as torch's reset does
        iterator = _LoaderIterator(self, start, indices, restore, shared_seed, carried, send)
        self._current = weakref.ref(iterator)
        return iterator

    def _options(self) -> Any:
        from ..options import Options

        context = self.multiprocessing_context
        if context is not None and not isinstance(context, str):
            context = context.get_start_method()
        return Options(
            num_workers=self.num_workers,
            multiprocessing_context=context,
            worker_prefetch_cnt=self.prefetch_factor or 0,
            main_prefetch_cnt=0,
            in_order=self.in_order,
            timeout=self.timeout or None,
            collect_stats=self.collect_stats,
            backend=self.backend,
            pin_memory=bool(self.pin_memory),
            device=self.device,
        )

    def _job(self) -> _Job:
        return _Job(
            self.dataset,
            self._dataset_kind,
            self._auto_collation,
            self.collate_fn,
            self.drop_last,
            self.batch_size,
            self.worker_init_fn,
            self.snapshot_every_n_steps,
        )

    # -- what the service adds -------------------------------------------------------------

    def stats(self) -> Any:
        """A snapshot of what every worker has done, with a sentence naming the bottleneck
        (``stats().summary()``); empty before the first epoch or without workers."""
        return self._family.stats()

    def explain(self) -> str:
        """The loader's plan as text: what runs in the workers and in this process."""
        from ..plan import plan

        if self.num_workers == 0:
            work = f"this process draws, fetches from {type(self.dataset).__name__} and collates every batch"
        elif self._dataset_kind == _DatasetKind.Iterable:
            work = f"each worker iterates its own replica of {type(self.dataset).__name__} and collates its batches"
        else:
            sampler = type(self.batch_sampler if self.batch_sampler is not None else self.sampler).__name__
            work = (
                f"the main process draws index batches from {sampler}; each worker fetches its share "
                f"(batch i goes to worker i % {self.num_workers}) from {type(self.dataset).__name__} and collates it"
            )
        header = f"mprs_plus.DataLoader: {work}; LoaderStage is that work.\n"
        return header + plan(LoaderStage(self._job()), self.num_workers).explain()

    # -- checkpoints -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The loader's position: restore it with ``load_state_dict()`` on a loader built the
        same way, and its next epoch goes on exactly after the last batch handed out here."""
        current = self._current() if self._current is not None else None
        if current is not None and not current.finished:
            return current.state_dict()
        if self._restore is not None:
            return dict(self._restore)
        start = capture_start(self, self._base_seed, not (self.persistent_workers and self._base_seed is not None))
        return loader_state.between(self, start, self._carry if self.persistent_workers else None)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume ``state_dict`` (from ``state_dict()`` of a loader built the same way) with
        the next ``iter()``. A state of another dataset length, batch size, worker count or
        dataset kind is a ``ValueError``."""
        self._restore = loader_state.check(self, state_dict)
        self._current = None  # state_dict() now reports the loaded state, until the next iter()
        run, self._run = self._run, None
        if run is not None:  # persistent workers seeded for another run: the restore starts its own
            run.stop()
            self._base_seed = None

    def __del__(self) -> None:
        run = getattr(self, "_run", None)
        if run is not None:
            run.stop()


class _Run:
    """One runtime of the loader's workers and the plan it runs."""

    def __init__(self, loader: DataLoader) -> None:
        from ..plan import plan
        from ..runtime.main.service import open_runtime

        options = loader._options()
        stage = LoaderStage(loader._job())
        self.plan = plan(stage, loader.num_workers)
        self.feeding = _open_feeding(options)
        if self.feeding is not None:
            self.plan = self.plan._replace(delivery=self.feeding.delivery)
        self.runtime = open_runtime(stage, self.plan, options)
        main = self.runtime.start()
        loader._family.started(self.runtime.figures)
        if self.feeding is not None:
            self.runtime.figures.feeding = self.feeding.counters
            main = self.feeding.wrap(main)
        self.main = main

    def stop(self) -> None:
        self.runtime.stop()
        feeding, self.feeding = self.feeding, None
        if feeding is not None:
            feeding.close()


def _open_feeding(options: Any) -> Any:
    if not options.pin_memory:
        return None
    from ..runtime.main.feeding import open_feeding

    return open_feeding(options.pin_memory, options.device, options.device_prefetch)



_MIRROR_END = object()


class _LoaderIterator:
    """One epoch of a ``DataLoader``, what ``iter(loader)`` returns."""

    def __init__(
        self,
        loader: DataLoader,
        start: EpochStart,
        indices: Iterator[Any],
        restore: dict[str, Any] | None,
        shared_seed: int | None = None,
        carried: dict[int, tuple[int, Any]] | None = None,
        send_carried: bool = False,
    ) -> None:
        self._loader_ref = weakref.ref(loader)
        self._shared_seed = shared_seed  # a DataPipe dataset's, as torch draws it
        self._distributed = _get_distributed_settings()
        self._length = _length_or_none(loader)
        self._timeout = loader.timeout
        self.start = start
        self.finished = False
        self._workers = loader.num_workers
        self._restore = restore
        # Per worker: (batches of this epoch its dataset state covers, that state).
        self._worker_states: dict[int, tuple[int, Any]] = dict(restore["worker_states"]) if restore else dict(carried or {})
        self._send_states = restore is not None or send_carried  # else the workers hold them already
        self._owns_run = False
        self._run: _Run | None = None
        self._mirror: Iterator[Any] | None = None  # a sampler without len(): see _in_workers
        self._yielded = restore["consumed"][0] if restore and loader.num_workers == 0 else 0
        # Batches the loop received, counted on from a restored state: with batches copied
        # to a device ahead of the loop, the reads run ahead of them.
        self._handed = sum(restore["consumed"]) if restore else 0
        self._ahead = 0
        self._feeding: Any = None
        self._in_order = loader.in_order
        self._kind = loader._dataset_kind
        if self._workers == 0:
            self._stage: LoaderStage | None = LoaderStage(loader._job())
            self._items = self._in_process(loader, indices)
            self._feeding = _open_feeding(loader._options())
            if self._feeding is not None:  # pinned, or on the device, as with workers
                self._items = self._feeding.iterate(self._items)
                self._ahead = self._feeding.ahead
        else:
            self._stage = None
            self._items = self._in_workers(loader, indices)

    def __iter__(self) -> _LoaderIterator:
        return self

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("this DataLoader's dataset has no len()")
        return self._length

    def __next__(self) -> Any:
        try:
            item = next(self._items)
        except StopIteration:
            self._finish()
            raise
        except Exception as exc:
            self._failed(exc)
            mapped = torch_error(exc, self._timeout)
            if mapped is None:
                raise
            raise mapped from None
        self._handed += 1
        if self._mirror is not None:
            self._follow(1)
        if type(item) is WithState:
            batch, worker, count, dataset_state = item
            self._worker_states[worker] = (count, dataset_state)
            return batch
        return item

    # -- in this process -----------------------------------------------------------------

    def _in_process(self, loader: DataLoader, indices: Iterator[Any]) -> Iterator[Any]:
        """Set up now (an iterable dataset's ``iter()`` is taken by ``iter(loader)``, as
        torch's); the batches, lazily from the sampler, as torch's single process makes them.
        A restored epoch reads its first batches' samples again and drops them (map-style),
        or goes on from the dataset's recorded state and replays the batches after it."""
        stage = self._stage
        if stage is None:
            raise RuntimeError("internal error: no stage for an in-process epoch")
        count, dataset_state = self._worker_states.get(0, (0, None)) if self._restore is not None else (0, None)
        # The batches handed out before the state are drawn again first (the sampler draws
        # before any sample is read, as in the run recorded); those after the dataset's
        # recorded state (all of them without one) are read again and dropped.
        skipped = list(itertools.islice(indices, self._yielded))[count:]
        stage.begin(
            WorkerEpoch(0, 1, self.start.base_seed or 0, None, dataset_state, shared_seed=self._shared_seed,
                        distributed=self._distributed),
            in_worker=False,
        )
        iterable = loader._dataset_kind == _DatasetKind.Iterable
        fetch = stage._fetcher.fetch if iterable else make_fetcher(stage.job).fetch
        if iterable:
            for index in skipped:
                with contextlib.suppress(StopIteration):
                    fetch(index)
        else:
            replay(stage.job, skipped)
        return self._fetched(indices, fetch)

    def _fetched(self, indices: Iterator[Any], fetch: Any) -> Iterator[Any]:
        for index in indices:
            try:
                batch = fetch(index)
            except StopIteration:  # an iterable dataset's fetcher: the epoch's end
                return
            self._yielded += 1
            yield batch

    # -- in workers ----------------------------------------------------------------------

    def _in_workers(self, loader: DataLoader, indices: Iterator[Any]) -> Iterator[Any]:
        """Start the epoch in the workers now (as ``iter()`` of torch's loader does): each
        worker gets its round-robin share of the epoch's index batches (map-style) or runs
        its replica (an iterable dataset); returns the batches as the runtime reads them."""
        workers = loader.num_workers
        if loader.prefetch_factor == 0:
            raise ValueError("prefetch_factor must be greater than 0 for num_workers > 0")
        base_seed = self.start.base_seed or 0
        shares: list[list[Any] | None] = [None] * workers
        sampler = None
        if loader._dataset_kind == _DatasetKind.Map:
            if has_len(loader._index_sampler):
                shares = list(deal(list(indices), workers))  # type: ignore[arg-type]
            else:  # drawn in the workers, a batch at a time (an infinite sampler has no list)
                sampler = (loader._index_sampler, torch.get_rng_state())
                # The main process's own iterator follows, as torch's main process draws:
                # prefetch_factor batches per worker at the start, then one per batch received.
                # (after the workers' copies are made: begin_epoch pickles them).
                self._mirror = indices
        parts = []
        for w in range(workers):
            count, dataset_state = self._worker_states.get(w, (0, None)) if self._send_states else (0, None)
            parts.append(
                WorkerEpoch(
                    w, workers, base_seed, shares[w], dataset_state, count, sampler, self._shared_seed, self._distributed
                )
            )
        run = loader._run if loader.persistent_workers else None
        if run is None:
            run = _Run(loader)
            if loader.persistent_workers:
                loader._run = run
            else:
                self._owns_run = True
        self._run = run
        self._ahead = run.feeding.ahead if run.feeding is not None else 0
        skips: tuple[int, ...] = ()
        next_worker = 0
        if self._restore is not None:
            skips, next_worker = tuple(self._restore["consumed"]), self._restore["next_worker"]
        try:
            run.runtime.begin_epoch(None, EpochOrders(parts), skips if any(skips) else (), next_worker)
            self._follow(loader.prefetch_factor * workers + sum(skips))
        except Exception as exc:
            mapped = torch_error(exc, self._timeout)
            if mapped is None:
                raise
            raise mapped from None
        return iter(run.main)

    def _follow(self, batches: int) -> None:
        """Advance the main process's own sampler iterator by ``batches``, dropping them
        (the workers draw the same from their copies): its generators move as torch's."""
        mirror = self._mirror
        if mirror is None:
            return
        for _ in range(batches):
            if next(mirror, _MIRROR_END) is _MIRROR_END:
                self._mirror = None
                return

    def _failed(self, exc: BaseException) -> None:
        """An epoch that raised ends its own workers, as torch's does; persistent workers
        stay for the next epoch unless the runtime itself failed (a worker died, a timeout)."""
        if self._owns_run:
            self._stop_owned()
            return
        loader = self._loader_ref()
        if loader is not None and loader._run is self._run and is_fatal(exc):
            run, loader._run = loader._run, None
            if run is not None:
                run.stop()

    def _finish(self) -> None:
        if not self.finished:
            self.finished = True
            loader = self._loader_ref()
            if loader is not None and self._workers and not self._owns_run:  # persistent workers
                loader._carry = {w: (0, state) for w, (_, state) in self._worker_states.items()}
            self._stop_owned()

    def _abandon(self) -> None:
        self._stop_owned()

    def _stop_owned(self) -> None:
        run, self._run = self._run, None
        if run is not None and self._owns_run:
            run.stop()
        feeding, self._feeding = self._feeding, None
        if feeding is not None:
            feeding.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._stop_owned()

    # -- checkpoints -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        loader = self._loader_ref()
        if loader is None:
            raise RuntimeError("internal error: a loader's iterator outlived its loader")
        if self._ahead and self._handed < (self._yielded if self._workers == 0 else self._read()):
            return loader_state.running(loader, self.start, *self._handed_counts(), dict(self._worker_states))
        if self._workers == 0:
            consumed, next_worker = [self._yielded], 0
            states = dict(self._worker_states)
            stage = self._stage
            if stage is not None and has_state(stage.job.dataset):
                states[0] = (self._yielded, dataset_state(stage.job.dataset, stage._fetcher))
        else:
            cursor = self._cursor()
            if cursor is None:
                consumed, next_worker = list(self._restore["consumed"]) if self._restore else [0] * self._workers, (
                    self._restore["next_worker"] if self._restore else 0
                )
            else:
                consumed, next_worker = list(cursor.consumed), cursor.next_worker
            states = dict(self._worker_states)
        return loader_state.running(loader, self.start, consumed, next_worker, states)

    def _cursor(self) -> Any:
        """The runtime's read cursor of this epoch, None before its first read; a
        RuntimeError once this epoch's workers are gone."""
        from ..errors import ServiceClosedError

        if self._run is None:
            return None
        try:
            return self._run.runtime.read_cursor()
        except ServiceClosedError:
            raise RuntimeError(
                "this DataLoader iterator's workers were stopped (an error, or load_state_dict() on its loader): "
                "take the state from a running iterator, or from the loader between epochs"
            ) from None

    def _read(self) -> int:
        cursor = self._cursor()
        return sum(cursor.consumed) if cursor is not None else self._handed

    def _handed_counts(self) -> tuple[list[int], int]:
        """Per worker, the batches the loop received, when batches were read ahead of it
        (copied to the device): map-style batches in order are dealt i % N, so the first n
        batches are worker w's first len(range(w, n, N)). Other loaders can only be counted
        as read, which would skip the batches on their way to the device."""
        if self._kind == _DatasetKind.Iterable or (self._workers and not self._in_order):
            raise ValueError(
                "state_dict() while batches are on their way to the device (device=) needs a map-style dataset "
                "read in order (in_order=True): take the state between epochs, or leave device=None"
            )
        n, workers = self._handed, max(self._workers, 1)
        return [len(range(w, n, workers)) for w in range(workers)], n % workers


def has_len(sampler: Any) -> bool:
    try:
        len(sampler)
    except TypeError:
        return False
    return True


def _length_or_none(loader: DataLoader) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None
