"""One epoch of a ``DataLoader``: what ``iter(loader)`` returns.

    in this process (num_workers=0)   the sampler, lazily; torch's fetcher; a restore draws
                                      the handed-out batches again and re-reads their samples
    in workers                        the epoch's index batches dealt round-robin in each
                                      worker's ``WorkerEpoch``; the runtime's reader yields
                                      their batches; a restore passes each worker's count
                                      to the runtime, which has the worker skip them

It counts what the loop received (checkpoints), records the dataset states workers send
along, and raises errors as torch's loader does.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch.autograd import _profiler_enabled
from torch.autograd.profiler import record_function
from torch.utils.data.dataloader import _DatasetKind, _get_distributed_settings

from ..errors import ServiceClosedError
from . import state as loader_state
from .batch_seeds import BatchSeeds, Kept
from .elastic import Layout, Remainder
from .epochs import EpochStart, deal_epoch, draw_batches, gather, has_len
from .errors import is_fatal, torch_error
from .stage import (
    BatchFailure,
    _Job,
    EndState,
    EpochOrders,
    LoaderStage,
    StateFailure,
    WithState,
    WorkerEpoch,
    dataset_state,
    make_fetcher,
    replay,
    takes_state,
)
from .workers import LoaderRun, open_feeding
from ..runtime.main.replacement import LostItem

_MIRROR_END = object()


class EpochSettings(NamedTuple):
    """What an epoch reads of its loader, taken by ``iter(loader)``: an epoch never reaches
    back into the loader (the class sits on top; ``LoaderKeep`` is what they share)."""

    num_workers: int
    persistent: bool  # persistent workers, kept in LoaderKeep.run
    prefetch_factor: int | None
    timeout: float
    in_order: bool
    kind: int  # torch's _DatasetKind
    index_sampler: Any
    job: _Job  # what each worker (or this process) fetches and collates with
    options: Any  # the runtime's Options
    pin_memory_device: str  # torch's argument: the device whose pinning the feeding uses
    family: Any  # the loader's statistics, which its runtimes join
    shape: dict[str, Any]  # the loader's shape, as its states record it
    length: int | None  # len(loader), None where it has none
    length_said: int | None  # an iterable dataset's len() the loop asked before this epoch
    dataset_name: str  # repr(dataset), for torch's warning
    dataset_type: str  # its class's name, for ours


class EpochPlan(NamedTuple):
    """Which of the epoch's batches are made, and how they are seeded (``seeding="batch"``,
    a restore at another count or world size)."""

    seeds: BatchSeeds | None = None  # seeding="batch": each batch seeded from its place
    layout: Layout = Layout()  # the batches still to make (all of them in a fresh epoch)
    batches: list[Any] | None = None  # the epoch's index batches, where not the sampler's (a Remainder's)
    remainder: Remainder | None = None  # a sharded epoch (DistributedSampler, BatchSamplerShard), as states record it


class LoaderKeep:
    """What a loader keeps from one epoch to the next, which its epochs update: the
    persistent workers' runtime, the datasets' states they carry into the next epoch, and
    whether the dataset's failing ``state_dict()`` was reported."""

    __slots__ = ("run", "carry", "state_warned", "auto")

    def __init__(self) -> None:
        self.run: LoaderRun | None = None
        self.auto: Any = None  # num_workers="auto": the loader's AutoWorkers (``auto.py``)
        self.carry: dict[int, tuple[int, Any]] = {}
        self.state_warned = False

    def __del__(self) -> None:
        # The loader and its last iterator are gone: the persistent workers end now, as
        # torch's do, even where something else still holds their runtime (a traceback kept
        # in a reference cycle holds it until Python's collector runs, maybe minutes later).
        run, self.run = self.run, None
        if run is not None:
            with contextlib.suppress(Exception):
                run.stop()


class LoaderIterator:
    """One epoch of a ``DataLoader``, what ``iter(loader)`` returns."""

    def __init__(
        self,
        settings: EpochSettings,
        keep: LoaderKeep,
        start: EpochStart,
        indices: Iterator[Any],
        restore: dict[str, Any] | None,
        shared_seed: int | None = None,
        carried: dict[int, tuple[int, Any]] | None = None,
        send_carried: bool = False,
        plan: EpochPlan = EpochPlan(),
    ) -> None:
        self._settings = settings
        self._plan = plan
        if plan.batches is not None:  # the epoch's batches, made here (a Remainder)
            indices = iter(plan.batches)
        self._keep = keep
        self._shared_seed = shared_seed  # a DataPipe dataset's, as torch draws it
        self._distributed = _get_distributed_settings()
        self._length = settings.length
        self._timeout = settings.timeout
        self.start = start
        self._fixed_state: dict[str, Any] | None = None
        self.finished = False
        self._num_workers = settings.num_workers
        self._worker_handles: list[Any] = []  # what _workers shows, once the workers are opened
        self._restore = restore
        # Per worker: (batches of this epoch its dataset state covers, that state).
        self._worker_states: dict[int, tuple[int, Any]] = dict(restore["worker_states"]) if restore else dict(carried or {})
        self._send_states = restore is not None or send_carried  # else the workers hold them already
        # What each worker's dataset began the epoch with: a worker whose state_dict() raised
        # is recorded as that again, and a restore replays its epoch from there.
        self._epoch_states = dict(self._worker_states)
        self._stateless: set[int] = set()  # workers whose state_dict() raised this epoch
        # Per worker: its iterable dataset's state once its iterator was exhausted (EndState).
        self._end_states: dict[int, Any] = {}
        self._owns_run = False
        self._run: LoaderRun | None = None
        self._mirror: Iterator[Any] | None = None  # a sampler without len(): see _in_workers
        self._shares: list[Any] = []
        self._yielded = restore["consumed"][0] if restore and settings.num_workers == 0 else 0
        # Batches the loop received, counted on from a restored state: with batches copied
        # to a device ahead of the loop, the reads run ahead of them.
        self._handed = sum(restore["consumed"]) if restore else 0
        # Batches returned to the loop (a worker's error is not one), as torch counts them
        # for its warning about an iterable dataset longer than its len().
        self._returned = self._handed
        self._ahead = 0
        self._feeding: Any = None
        # num_workers="auto" (``auto.py``): the epoch's index batches, and each worker's places
        # in it, so that what is left can be dealt anew over another count.
        self._auto = keep.auto if settings.num_workers > 0 else None
        self._every: list[Any] = []
        self._positions: list[list[int]] = []
        self._run_base = 0  # batches the loop had when the current run began (a resize's)
        self._in_order = settings.in_order
        self._kind = settings.kind
        # An iterable dataset whose len() the loop asked before this epoch: torch warns
        # once the epoch yields more than that.
        self._length_said = settings.length_said if self._kind == _DatasetKind.Iterable else None
        self._dataset_name = settings.dataset_name
        if self._num_workers == 0:
            self._stage: LoaderStage | None = LoaderStage(settings.job)
            self._items = self._in_process(indices)
            self._feeding = open_feeding(settings.options, settings.pin_memory_device)
            if self._feeding is not None:  # pinned, or on the device, as with workers
                self._items = self._feeding.iterate(self._items)
                self._ahead = self._feeding.ahead
        else:
            self._stage = None
            self._items = self._in_workers(indices)

    def __iter__(self) -> LoaderIterator:
        return self

    @property
    def _workers(self) -> list[Any]:
        """The worker processes, as torch's iterator lists them (``pid``, ``exitcode``,
        ``is_alive()``, ``join()``): code that watches its workers reads them here. Kept
        once the epoch's workers stopped, as torch's list is; empty without workers."""
        return list(self._worker_handles)

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("this DataLoader's dataset has no len()")
        return self._length

    def __next__(self) -> Any:
        # As torch's iterator marks its next(): profilers (torch.profiler's TensorBoard view,
        # Holistic Trace Analysis) count a step's data loading by this range's name. Asked
        # per batch, one C call: nothing is recorded, and next to nothing paid, without one.
        if _profiler_enabled():
            with record_function(f"enumerate(DataLoader)#{type(self).__name__}.__next__"):
                return self._next()
        return self._next()

    def _next(self) -> Any:
        auto = self._auto
        try:
            if auto is None:
                item = next(self._items)
            else:
                began = time.perf_counter()
                item = next(self._items)
                auto.waited(time.perf_counter() - began, self._run)
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
        if type(item) is EndState:  # not a batch: a worker's dataset state at its end
            worker, dataset_state = item
            if type(dataset_state) is StateFailure:
                self._state_failed(worker, dataset_state)
            else:
                self._end_states[worker] = dataset_state
            return self._next()
        if self._mirror is not None:
            self._follow(1)
        if type(item) is BatchFailure:  # that batch's error; the epoch goes on, as torch's does
            error = item[0].rebuild()
            raise (torch_error(error, self._timeout) or error) from None
        if type(item) is LostItem:  # a batch that killed two workers in turn (worker_restarts)
            raise item.error(self._batch_named(item.worker, item.position)) from None
        self._returned += 1
        if auto is not None and auto.due():
            self._maybe_resize(auto)
        if self._length_said is not None and self._returned > self._length_said:
            self._warn_past_length()
        if type(item) is WithState:
            batch, worker, count, dataset_state = item
            if type(dataset_state) is StateFailure:
                self._state_failed(worker, dataset_state)
            else:
                self._worker_states[worker] = (count, dataset_state)
            return batch
        return item

    # -- in this process -----------------------------------------------------------------

    def _in_process(self, indices: Iterator[Any]) -> Iterator[Any]:
        """Set up now (an iterable dataset's ``iter()`` is taken by ``iter(loader)``, as
        torch's); the batches, lazily from the sampler, as torch's single process makes them.
        A restored epoch reads its first batches' samples again and drops them (map-style),
        or goes on from the dataset's recorded state and replays the batches after it."""
        stage = self._stage
        if stage is None:
            raise RuntimeError("internal error: no stage for an in-process epoch")
        restored = self._restore is not None or self._send_states  # a state mid-epoch, or between epochs
        count, dataset_state = self._worker_states.get(0, (0, None)) if restored else (0, None)
        # The batches handed out before the state are drawn again first (the sampler draws
        # before any sample is read, as in the run recorded); those after the dataset's
        # recorded state (all of them without one) are read again and dropped.
        skipped = list(itertools.islice(indices, self._yielded))[count:]
        stage.begin(
            WorkerEpoch(0, 1, self.start.base_seed or 0, None, dataset_state, shared_seed=self._shared_seed,
                        distributed=self._distributed),
            in_worker=False,
        )
        iterable = self._kind == _DatasetKind.Iterable
        fetch = stage._fetcher.fetch if iterable else make_fetcher(stage.job).fetch
        if iterable:
            for index in skipped:
                with contextlib.suppress(StopIteration):
                    fetch(index)
        else:
            replay(stage.job, skipped)
        seeds = self._plan.seeds
        if seeds is None:
            return _Fetched(self, indices, fetch)
        layout = self._plan.layout
        numbered: Iterator[tuple[int, Any]] = enumerate(indices)
        if not layout.fresh:
            numbered = ((p, index) for p, index in numbered if layout.keeps(p))
        return _SeededFetched(self, numbered, fetch, seeds, iterable)

    # -- in workers ----------------------------------------------------------------------

    def _in_workers(self, indices: Iterator[Any]) -> Iterator[Any]:
        """Start the epoch in the workers now (as ``iter()`` of torch's loader does): each
        worker gets its round-robin share of the epoch's index batches (map-style) or runs
        its replica (an iterable dataset); returns the batches as the runtime reads them."""
        settings = self._settings
        workers = settings.num_workers
        if settings.prefetch_factor == 0:
            raise ValueError("prefetch_factor must be greater than 0 for num_workers > 0")
        run = self._keep.run if settings.persistent else None
        if run is None:
            run = LoaderRun(settings.options, settings.job, workers, settings.family, settings.pin_memory_device)
            if settings.persistent:
                self._keep.run = run
            else:
                self._owns_run = True
        self._run = run
        self._worker_handles = run.runtime.worker_processes()
        # Drawn once the run is open, as torch reads its sampler once its workers started:
        # spawned children boot meanwhile (forked ones start with the epoch, already drawn).
        try:
            parts = self._orders(indices)
        except BaseException:
            self._stop_owned()
            raise
        self._ahead = run.feeding.ahead if run.feeding is not None else 0
        if self._auto is not None:
            self._auto.epoch_began()
            self._auto.begin()
        skips: tuple[int, ...] = ()
        next_worker = 0
        if self._restore is not None:
            skips, next_worker = tuple(self._restore["consumed"]), self._restore["next_worker"]
        try:
            run.runtime.begin_epoch(None, EpochOrders(parts), skips if any(skips) else (), next_worker)
            self._follow(settings.prefetch_factor * workers + sum(skips))
        except Exception as exc:
            mapped = torch_error(exc, self._timeout)
            if mapped is None:
                raise
            raise mapped from None
        if self._auto is not None:
            self._auto.note_started(run)
        return iter(run.main)

    def _orders(self, indices: Iterator[Any]) -> list[WorkerEpoch]:
        """Each worker's order for the epoch: its round-robin share of the epoch's index
        batches, drawn now (map-style), or its replica's state (an iterable dataset)."""
        settings = self._settings
        workers = settings.num_workers
        base_seed = self.start.base_seed or 0
        shares: list[Any] = [None] * workers
        positions: list[Any] = [None] * workers  # seeding="batch": each share's places in the epoch (None: i * N + w)
        sampler = None
        plan = self._plan
        if settings.kind == _DatasetKind.Map:
            if self._auto is not None or plan.batches is not None or not plan.layout.fresh:
                # num_workers="auto" keeps every batch here, with its place: a resize deals the rest anew.
                every = plan.batches if plan.batches is not None else draw_batches(settings.index_sampler, indices)
                positions = plan.layout.deal(len(every), workers)
                shares = [gather(every, share) for share in positions]
                self._every, self._positions = every, positions
            elif has_len(settings.index_sampler):
                shares = deal_epoch(settings.index_sampler, indices, workers)
            else:  # drawn in the workers, a batch at a time (an infinite sampler has no list)
                sampler = (settings.index_sampler, torch.get_rng_state())
                # The main process's own iterator follows, as torch's main process draws:
                # prefetch_factor batches per worker at the start, then one per batch received.
                # (after the workers' copies are made: begin_epoch pickles them).
                self._mirror = indices
        self._shares = shares  # each worker's index batches, where dealt here: a lost batch is named by them
        parts = []
        for w in range(workers):
            count, dataset_state = self._worker_states.get(w, (0, None)) if self._send_states else (0, None)
            parts.append(
                WorkerEpoch(
                    w, workers, base_seed, shares[w], dataset_state, count, sampler, self._shared_seed, self._distributed,
                    plan.seeds, positions[w],
                )
            )
        return parts

    # -- num_workers="auto" ------------------------------------------------------------

    def _maybe_resize(self, auto: Any) -> None:
        """The policy judged a window (``auto.py``): where it asks for another count, what
        the loop has not received is dealt anew over that many new workers, exactly as a
        state restores at another count (``elastic.Layout``: the layout folded with what
        each worker handed out). The new workers start first; the old ones then stop, and
        what they had made beyond the loop's batches is made again by the new ones."""
        run = self._run
        decision = auto.decide(lambda: self._batches_left(run))
        if decision is None or run is None:
            return
        count = decision.workers
        layout = self._layout_left(run)
        total = len(self._every)
        if layout is None or sum(len(share) for share in layout.deal(total, 1)) < 2 * count:
            return  # too near the epoch's end to be worth a start (or not to be told): the next epoch starts with it
        positions = layout.deal(total, count)
        settings = self._settings
        options = settings.options._replace(num_workers=count)
        new = LoaderRun(options, settings.job, count, settings.family, settings.pin_memory_device)
        if not self._owns_run:  # persistent workers: the loader keeps the new ones
            self._keep.run = new
        self._run = new
        # From here the epoch is this count's: its states say so, with what is left.
        self._settings = settings._replace(num_workers=count, options=options, shape={**settings.shape, "num_workers": count})
        self._num_workers = count
        self._plan = self._plan._replace(layout=layout)
        self._fixed_state = None
        self._positions = positions
        self._shares = [gather(self._every, places) for places in positions]
        base_seed = self.start.base_seed or 0
        parts = [
            WorkerEpoch(
                w, count, base_seed, self._shares[w], None, 0, None, self._shared_seed, self._distributed,
                self._plan.seeds, positions[w],
            )
            for w in range(count)
        ]
        self._worker_handles = new.runtime.worker_processes()
        self._ahead = new.feeding.ahead if new.feeding is not None else 0
        self._run_base = self._handed  # the new run's cursor counts from here
        self._restore = None
        auto.begin()
        try:
            # The new workers start (under fork, here) while the old ones are stopped next.
            new.runtime.begin_epoch(None, EpochOrders(parts))
        except Exception as exc:
            run.stop()
            mapped = torch_error(exc, self._timeout)
            if mapped is None:
                raise
            raise mapped from None
        run.stop()
        auto.note_started(new)
        self._items = iter(new.main)

    def _batches_left(self, run: LoaderRun | None) -> int | None:
        """Batches of the epoch the loop has not received; None where it cannot be told."""
        layout = self._layout_left(run) if run is not None else None
        if layout is None:
            return None
        return sum(len(share) for share in layout.deal(len(self._every), 1))

    def _layout_left(self, run: LoaderRun) -> Layout | None:
        """What the loop has not received of the epoch, as a layout; None where it cannot
        be told (batches on their way to the device, taken as they are ready)."""
        cursor = run.runtime.read_cursor()
        workers = len(self._positions)
        consumed = list(cursor.consumed) if cursor is not None else [0] * workers
        ahead = sum(consumed) - (self._handed - self._run_base)
        if self._ahead and ahead > 0:
            if not self._in_order:
                return None
            turn = cursor.next_worker if cursor is not None else 0
            for _ in range(ahead):  # read, not yet received: the last reads, in turn backwards
                turn = (turn - 1) % workers
                consumed[turn] -= 1
        return self._plan.layout.fold(workers, consumed)

    def _batch_named(self, worker: int, position: int) -> str:
        """How a lost batch is named: its indices when this process dealt them."""
        share = self._shares[worker] if worker < len(self._shares) else None
        if share is not None and position < len(share):
            return f"batch {position} of worker {worker} (indices {list(share[position])})"
        return f"batch {position} of worker {worker}"

    def _warn_past_length(self) -> None:
        """torch's warning, in torch's words (code that filters it keeps working)."""
        import warnings

        message = (
            f"Length of IterableDataset {self._dataset_name} was reported to be {self._length_said}"
            f"(when accessing len(dataloader)), but {self._returned} samples have been fetched. "
        )
        if self._num_workers > 0:
            message += (
                "For multiprocessing data-loading, this could be caused by not properly configuring the "
                "IterableDataset replica at each worker. Please see "
                "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset for examples."
            )
        warnings.warn(message, stacklevel=3)

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
        keep = self._keep
        if keep.run is self._run and is_fatal(exc):
            run, keep.run = keep.run, None
            if run is not None:
                run.stop()

    def _finish(self) -> None:
        if not self.finished:
            self.finished = True
            if self._num_workers and not self._owns_run:  # persistent workers
                carry = {w: (0, state) for w, (_, state) in self._worker_states.items()}
                carry.update((w, (0, state)) for w, state in self._end_states.items())
                for worker in self._stateless:  # its dataset as the epoch left it is unknown
                    carry.pop(worker, None)
                self._keep.carry = carry
            self._stop_owned()

    def _abandon(self) -> None:
        self._stop_owned()

    def _stop_owned(self) -> None:
        run, self._run = self._run, None
        if run is not None and self._owns_run:
            run.stop()
            if self._auto is not None:
                self._auto.run_stopped()
        feeding, self._feeding = self._feeding, None
        if feeding is not None:
            feeding.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._stop_owned()

    # -- checkpoints -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        if self._ahead and self._handed - self._run_base < (self._yielded if self._num_workers == 0 else self._read()):
            return self._running(*self._handed_counts(), dict(self._worker_states))
        if self._num_workers == 0:
            consumed, next_worker = [self._yielded], 0
            states = dict(self._worker_states)
            stage = self._stage
            if stage is not None and takes_state(stage.job.dataset, stage._fetcher) and not self._stateless:
                state = dataset_state(stage.job.dataset, stage._fetcher)
                if type(state) is StateFailure:
                    self._state_failed(0, state)
                    states = dict(self._worker_states)
                else:
                    states[0] = (self._yielded, state)
        else:
            cursor = self._cursor()
            if cursor is None:
                consumed, next_worker = list(self._restore["consumed"]) if self._restore else [0] * self._num_workers, (
                    self._restore["next_worker"] if self._restore else 0
                )
            else:
                consumed, next_worker = list(cursor.consumed), cursor.next_worker
            states = dict(self._worker_states)
        return self._running(consumed, next_worker, states)

    def _state_failed(self, worker: int, failure: StateFailure) -> None:
        """A worker's ``state_dict()`` raised: its epoch is recorded as begun, and a restore
        replays it (exact where the dataset reads the same samples again, as any dataset
        without a state); the loader warns once."""
        self._stateless.add(worker)
        if worker in self._epoch_states:
            self._worker_states[worker] = self._epoch_states[worker]
        else:
            self._worker_states.pop(worker, None)
        warn_state_failed(self._keep, self._settings.dataset_type, failure[0])

    def _running(self, consumed: list[int], next_worker: int, states: dict[int, Any]) -> dict[str, Any]:
        # What stays the same through the epoch (the loader's shape, the epoch's start) is
        # built once: a state after every batch costs the loop little (each state still
        # gets dicts of its own).
        fixed = self._fixed_state
        if fixed is None:
            fixed = self._fixed_state = loader_state.running(self._settings.shape, self.start, [], 0, {})
        if "layout" not in fixed:
            plan = self._plan
            fixed["layout"] = None if plan.layout.fresh else plan.layout.to_dict()
            fixed["distributed"] = None if plan.remainder is None else plan.remainder.to_dict()
            fixed["world_size"] = plan.remainder.world if plan.remainder is not None else self._distributed[0]
        return {
            **fixed, "shape": dict(fixed["shape"]), "start": dict(fixed["start"]), "consumed": consumed,
            "next_worker": next_worker, "worker_states": states,
            "layout": None if fixed["layout"] is None else dict(fixed["layout"], done=list(fixed["layout"]["done"])),
            "distributed": None if fixed["distributed"] is None else dict(fixed["distributed"]),
        }

    def _cursor(self) -> Any:
        """The runtime's read cursor of this epoch, None before its first read; a
        RuntimeError once this epoch's workers are gone."""
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
        if self._kind == _DatasetKind.Iterable or (self._num_workers and not self._in_order):
            raise ValueError(
                "state_dict() while batches are on their way to the device (device=) needs a map-style dataset "
                "read in order (in_order=True): take the state between epochs, or leave device=None"
            )
        n, workers = self._handed - self._run_base, max(self._num_workers, 1)  # of the current run (auto's resizes)
        return [len(range(w, n, workers)) for w in range(workers)], n % workers


def warn_state_failed(keep: LoaderKeep, dataset_type: str, error: str) -> None:
    """Once per loader: its dataset's ``state_dict()`` raised, the batches go on."""
    if keep.state_warned:
        return
    keep.state_warned = True
    from ..user_frame import warn

    warn(
        f"{dataset_type}.state_dict() raised {error}. The batches go on; this "
        "DataLoader's states now restore that dataset by replaying its epoch from the start, as for a "
        "dataset without state_dict() (exact where it reads the same samples again)"
    )


class _Fetched:
    """The batches of an epoch in this process, one ``next()`` each, as torch's single
    process makes them: not a generator, so that a batch that raises leaves the epoch
    going on (a generator that raised is done)."""

    def __init__(self, owner: LoaderIterator, indices: Iterator[Any], fetch: Any) -> None:
        self._owner = owner
        self._indices = indices
        self._fetch = fetch

    def __iter__(self) -> _Fetched:
        return self

    def __next__(self) -> Any:
        index = next(self._indices)
        self._owner._yielded += 1
        return self._fetch(index)  # an iterable dataset's end is its fetcher's StopIteration


class _SeededFetched(_Fetched):
    """``seeding="batch"`` in this process: each batch made with the seeds of its place in
    the epoch, the trainer's own generators kept around it (captured before, loaded after)."""

    def __init__(self, owner: LoaderIterator, numbered: Iterator[tuple[int, Any]], fetch: Any, seeds: BatchSeeds,
                 iterable: bool) -> None:
        super().__init__(owner, numbered, fetch)
        self._seeds = seeds
        self._iterable = iterable
        self._kept = Kept()

    def __next__(self) -> Any:
        position, index = next(self._indices)
        owner = self._owner
        kept = self._kept
        kept.keep()
        try:
            # An iterable dataset's batches are numbered in its stream, as a worker's are.
            self._seeds.apply(owner._yielded, 0) if self._iterable else self._seeds.apply(position)
            owner._yielded += 1
            return self._fetch(index)
        finally:
            kept.give_back()
