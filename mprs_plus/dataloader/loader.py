"""``mprs_plus.DataLoader``: torch's ``DataLoader`` API, run by the service's runtime.

    DataLoader.__iter__ --> draw the epoch in this process, as torch does (epochs.py)
                        --> an epoch (iterator.py): num_workers=0 fetches and collates here,
                            lazily, as torch does; else the plan of one DataPipe,
                            LoaderStage (stage.py), replicated in every worker, runs on the
                            runtime (workers.py): begin_epoch(no seed generator, each
                            worker's WorkerEpoch: its round-robin share of the index
                            batches), then the workers are read round-robin (or as ready)
    state_dict()        --> what drew the epoch + the runtime's read cursor (state.py)
    errors              --> torch's types and wording (errors.py)

Persistent workers keep one runtime for the loader's life; otherwise every epoch starts
its own, and stops it when the epoch ends or its iterator is dropped, as torch does.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, TypeVar

from torch.utils.data import DataLoader as _TorchDataLoader
from torch.utils.data.dataloader import _DatasetKind

from . import state as loader_state
from .epochs import EpochStart, capture_start, draw_epoch, set_start
from .batch_seeds import BATCH, BatchSeeds, batch_shard, check_seeding, distributed_sampler, rank_of
from .elastic import Layout, Remainder
from .iterator import EpochPlan, EpochSettings, LoaderIterator, LoaderKeep, warn_state_failed
from .stage import LoaderStage, StateFailure, _Job, has_state, snapshot
from ..runtime.timeline import Span
from .auto import AUTO, AutoCount, AutoWorkers, check_max_workers


_T_co = TypeVar("_T_co", covariant=True)


# Messages a worker's channel holds when prefetch_factor is left out. A batch of 128 KiB
# or more is a message of its own, so torch's 2 left each worker waiting on the loop's
# every read, a wake-up on each side per batch: rows of an in-memory tensor in batches of
# 128 ran at 0.97x num_workers=0 with 2 and 1.09x with 8 (2 cores, 2 workers, two runs
# each; 1 MiB tensors in batches of 8: 0.49x and 0.59x). 32 rather than 8: with two
# workers on two cores the main process runs on one worker's core more than the
# other's, and the worker ahead then waited for room; 32 gave rows 4% more (five
# alternating runs each, 685-705k against 704-733k samples/s). Bytes stay bounded as
# before: a channel's ring, 64 MiB, and what it lends in flight.
RUN_AHEAD_MESSAGES = 32

class DataLoader(_TorchDataLoader[_T_co]):
    """torch's ``DataLoader``, with the same arguments, defaults, attributes and batches,
    run by mprs_plus's workers; plus ``StatefulDataLoader``'s ``state_dict()`` and
    ``load_state_dict()``, exact at any batch.

    The arguments under "Args" are torch's, with its defaults and meaning (in short
    below; torch's documentation has the rest). Those under "Other parameters" are this
    project's, keyword-only.

    Args:
        dataset: a map-style dataset (``__getitem__`` and ``__len__``) or an iterable one.
        batch_size: items per batch; None hands out items one by one, uncollated.
        shuffle: True draws a new order every epoch (map-style datasets only).
        sampler: the order of the indices, instead of ``shuffle``.
        batch_sampler: the indices of each batch, instead of ``batch_size``, ``shuffle``,
            ``sampler`` and ``drop_last``.
        num_workers: worker processes; 0 loads in the calling process.
        collate_fn: makes a batch of a list of items (torch's ``default_collate`` when None).
        pin_memory: page-locks the batches' tensors, for fast copies to a GPU.
        drop_last: leaves out the last batch when it is short.
        timeout: seconds to wait for a batch from the workers before an error; 0 waits as
            long as they are alive (a dead one is an error at once).
        worker_init_fn: ``fn(worker_id)``, once in each worker before it loads.
        multiprocessing_context: "fork", "spawn", "forkserver" (or such a context), or None
            for the default.
        generator: the ``torch.Generator`` that draws the shuffle and the workers' seeds.
        prefetch_factor: batches each worker may load ahead (keyword-only, as in torch).
        persistent_workers: keeps the workers from one epoch to the next.
        pin_memory_device: the device to pin for (torch's, deprecated there).
        in_order: True hands out batches in the sampler's order; False as workers finish them.

    Other Parameters:
        snapshot_every_n_steps: an iterable dataset with ``state_dict()`` has its state
            taken in each worker every n batches (``StatefulDataLoader``'s argument); a
            restore replays at most n - 1 batches of a worker. Map-style datasets need none.
        device: with ``pin_memory=True``, e.g. ``"cuda"``: batches reach the loop already
            on that device, copied on the service's own stream ahead of the loop.
        backend: where the workers run: None for processes of this host,
            ``mprs_plus.RayBackend(...)`` for Ray actors (the same batches).
        collect_stats: keep live statistics for ``stats()``.
        worker_restarts: dead worker processes replaced in the loader's life, all workers
            together (default 0: a dead worker is an error, as with torch). The loop gets
            the uninterrupted run's batches (the documentation's page "When a worker dies").
        seeding: ``"worker"`` (default, torch's: worker k seeded once with base_seed + k)
            or ``"batch"``: ``random``, numpy's and torch's global generators seeded before
            each batch from the base seed, the epoch, the rank and the batch's place, so the
            batches are the same for any ``num_workers`` and states restore at any count
            (the documentation's page "Elastic workers").
        timeline: record a timeline of every worker and of the loop, for
            ``stats().write_timeline(path)``: True, False (default), or the spans kept per
            process (the documentation's page "Profiling a run").
        max_workers: the cap of ``num_workers="auto"``, with which the count is chosen while
            the epochs run: it starts small and grows while the loop waits for busy workers
            (past the cores for samples that wait on storage), within ``max_workers``
            (default 4x the cores) and the memory available; ``stats()`` says the count and
            why. ``"auto"`` implies ``seeding="batch"`` unless seeding is given (the
            documentation's page "Elastic workers").
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int | str = 0,
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
        worker_restarts: int = 0,
        seeding: str | None = None,
        timeline: bool | int = False,
        max_workers: int | None = None,
    ) -> None:
        from ..runtime.main.family import Family

        # This loader's own runtime state is set before torch's __init__ runs: a trainer that
        # records the attributes set after it (Lightning, to re-create a loader with its own
        # sampler) replays them on the copy, which must get its own.
        # What the epochs share and update: persistent workers' runtime, the datasets'
        # states they carry, a warning given.
        self._keep = LoaderKeep()
        self._current: weakref.ref[LoaderIterator] | None = None
        self._restore: dict[str, Any] | None = None  # load_state_dict(): for the next __iter__
        self._base_seed: int | None = None  # persistent workers: drawn with their first epoch
        self._epoch = 0  # epochs begun (iter() calls): part of a batch's seeds with seeding="batch"
        self._family = Family.new()
        auto = _is_auto(num_workers)
        if auto:  # the policy and its count, which the epochs share (``auto.py``)
            if isinstance(num_workers, AutoCount) and max_workers is None:
                max_workers = int(num_workers)  # a trainer re-creating the loader from its attributes
            self._keep.auto = AutoWorkers(check_max_workers(max_workers))
        elif max_workers is not None:
            raise ValueError("max_workers caps num_workers='auto'; with a fixed num_workers, leave it None")
        # By keyword: a trainer that records this call to re-create the loader (Lightning,
        # when this class was made after it wrapped torch's __init__) reads each argument
        # by its name, whatever its position.
        super().__init__(
            dataset=dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            # torch's checks see a count (one worker: "auto" starts small); the attribute
            # reads "auto" once torch's __init__ is done.
            num_workers=1 if auto else num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        if isinstance(snapshot_every_n_steps, bool) or not isinstance(snapshot_every_n_steps, int) or snapshot_every_n_steps < 0:
            raise ValueError(
                f"snapshot_every_n_steps must be an int >= 0 (0: only at a worker's end), got {snapshot_every_n_steps!r}"
            )
        # The arguments beyond torch's, set after its __init__: the copy gets them too.
        self.snapshot_every_n_steps = snapshot_every_n_steps
        # torch's attribute reads 2 with workers whatever was passed; the bound on what a
        # worker fetches ahead follows what the user asked for (see _options).
        self._prefetch_asked = prefetch_factor
        self.device = device
        self.backend = backend
        self.collect_stats = collect_stats
        self.worker_restarts = worker_restarts  # dead workers replaced in the loader's life (docs/worker-restarts.md)
        self.timeline = timeline  # record a timeline of every process (see docs/profiling.md)
        # "auto" changes the count inside an epoch: its batches must not depend on it.
        self.seeding = check_seeding(("batch" if auto else "worker") if seeding is None else seeding)
        self.max_workers = max_workers
        if auto:
            self.num_workers = AutoCount(self._keep.auto.policy.max_workers)  # reads "auto"; as a number, the cap
            _check_auto_fits(self)
        self._options()  # checked now, as torch checks its own arguments

    # -- iterating ---------------------------------------------------------------------

    def __iter__(self) -> LoaderIterator:  # type: ignore[override]
        restore, self._restore = self._restore, None
        persistent = self.persistent_workers and self._workers_now > 0
        carried, send = dict(self._keep.carry) if persistent else {}, False
        adapted = None
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
                adapted = loader_state.adapt(self, restore)
                restore = adapted.state
        else:
            start = capture_start(self, self._base_seed, not (persistent and self._base_seed is not None))
        self._epoch = start.epoch + 1
        base_seed, shared_seed, indices = draw_epoch(self, start)
        start = start._replace(base_seed=base_seed)
        plan = self._epoch_plan(start, adapted)
        if persistent:
            self._base_seed = base_seed
        previous = self._current() if self._current is not None else None
        if previous is not None and persistent:
            previous._abandon()  # its epoch ends: the workers move on to this one, as torch's reset does
        iterator = LoaderIterator(
            self._epoch_settings(), self._keep, start, indices, restore, shared_seed, carried, send, plan
        )
        self._current = weakref.ref(iterator)
        return iterator

    def _epoch_plan(self, start: EpochStart, adapted: loader_state.Adapted | None) -> EpochPlan:
        """Which batches the epoch makes (a restore's, folded) and, with seeding="batch", their seeds."""
        sampler = distributed_sampler(self.sampler, self.batch_sampler)
        shard = batch_shard(self.batch_sampler)
        if adapted is not None:
            layout, remainder = adapted.layout, adapted.remainder
            batches = adapted.batches() if adapted.batches is not None else None
        else:
            layout, batches, remainder = Layout(), None, None
        if remainder is None and sampler is not None:
            remainder = Remainder.of(sampler)  # recorded: a state restores at another world size
        elif remainder is None and shard is not None:
            remainder = Remainder.of_shard(shard)
        seeds = None
        if self.seeding == BATCH:
            from torch.utils.data.dataloader import _get_distributed_settings

            rank = rank_of(self.sampler, self.batch_sampler, _get_distributed_settings())
            # The rest of an epoch split over another world size: seeds of its own.
            extra = (remainder.done,) if remainder is not None and remainder.done else ()
            seeds = BatchSeeds(start.base_seed or 0, start.epoch, rank, extra)
        return EpochPlan(seeds, layout, batches, remainder)

    @property
    def _workers_now(self) -> int:
        """The worker count of the next epoch: the one ``num_workers="auto"`` chose last."""
        auto = self._keep.auto
        return auto.count if auto is not None else self.num_workers

    @property
    def _run(self) -> Any:
        """Persistent workers' runtime, kept across epochs (None without)."""
        return self._keep.run

    def _epoch_settings(self) -> EpochSettings:
        return EpochSettings(
            num_workers=self._workers_now,
            persistent=bool(self.persistent_workers and self._workers_now > 0),
            prefetch_factor=self.prefetch_factor,
            timeout=self.timeout,
            in_order=self.in_order,
            kind=self._dataset_kind,
            index_sampler=self._index_sampler,
            job=self._job(),
            options=self._options(),
            pin_memory_device=self.pin_memory_device,
            family=self._family,
            shape=loader_state.shape(self),
            length=_length_or_none(self),
            length_said=self._IterableDataset_len_called,
            # Named only where torch's warning may need it: the repr of a map-style dataset
            # that is a list of 1.5M records took 16 s of the first batch.
            dataset_name=repr(self.dataset) if self._IterableDataset_len_called is not None else "",
            dataset_type=type(self.dataset).__name__,
        )

    def _options(self) -> Any:
        from ..options import Options

        context = self.multiprocessing_context
        if context is not None and not isinstance(context, str):
            context = context.get_start_method()
        workers = self._workers_now
        return Options(
            num_workers=workers,
            multiprocessing_context=context,
            # Messages each worker's channel holds: prefetch_factor's, or at least
            # RUN_AHEAD_MESSAGES when it was left out.
            worker_prefetch_cnt=(self.prefetch_factor or 0)
            if self._prefetch_asked is not None
            else max(self.prefetch_factor or 0, RUN_AHEAD_MESSAGES),
            main_prefetch_cnt=0,
            # A prefetch_factor the user passed is torch's promise: a worker fetches at most
            # that many batches beyond those the loop received (a channel message may hold
            # many small batches). Left at torch's default, the workers run as far ahead as
            # their channels let them (bounded in bytes and items): a bound of 2 would keep
            # every worker waiting on the loop after each small batch, at a third of the rate
            # (ints in batches of 64: 1.2M samples/s against 3.9M on 2 cores).
            items_ahead=(self._prefetch_asked or None) if workers > 0 else None,
            in_order=self.in_order,
            timeout=self.timeout or None,
            collect_stats=self.collect_stats or self._keep.auto is not None,  # "auto" decides on them
            backend=self.backend,
            pin_memory=bool(self.pin_memory),
            device=self.device,
            worker_restarts=self.worker_restarts,
            timeline=getattr(self, "timeline", False),
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
        stats = self._family.stats()
        auto = self._keep.auto
        if auto is None:
            return stats
        from dataclasses import replace

        return replace(stats, workers_chosen=auto.summary())

    def explain(self) -> str:
        """The loader's plan as text: what runs in the workers and in this process."""
        from ..plan import plan

        workers = self._workers_now
        if workers == 0:
            work = f"this process draws, fetches from {type(self.dataset).__name__} and collates every batch"
        elif self._dataset_kind == _DatasetKind.Iterable:
            work = f"each worker iterates its own replica of {type(self.dataset).__name__} and collates its batches"
        else:
            sampler = type(self.batch_sampler if self.batch_sampler is not None else self.sampler).__name__
            work = (
                f"the main process draws index batches from {sampler}; each worker fetches its share "
                f"(batch i goes to worker i % {workers}) from {type(self.dataset).__name__} and collates it"
            )
        header = f"mprs_plus.DataLoader: {work}; LoaderStage is that work.\n"
        auto = self._keep.auto
        if auto is not None:
            chosen = auto.summary() if auto.policy.decisions[1:] else f"num_workers='auto': starts with {workers}"
            header += (
                f"{chosen}. The count is chosen while the epochs run, up to max_workers={auto.policy.max_workers} "
                f"({auto.policy.cores} cores usable), within the memory available.\n"
            )
        if self.worker_restarts and workers > 0:
            made = self.stats().replacements
            causes = ", ".join(f"{cause} x{count}" for cause, count in self.stats().replacement_causes.items())
            header += (
                f"A dead worker is replaced, {self.worker_restarts} times at most (worker_restarts); "
                f"replaced so far: {len(made)}{f' ({causes})' if made else ''}.\n"
            )
        if self.seeding == BATCH:
            header += (
                "Each batch seeds random, numpy and torch from (base seed, epoch, rank, its place) (seeding=\"batch\"): "
                "the same batches for any num_workers.\n"
            )
        text = header + plan(LoaderStage(self._job()), workers).explain()
        memory = self._family.stats().memory  # what its workers did so far: "" before they ran
        return f"{text}\nmemory: {memory}\n" if memory else text

    # -- checkpoints -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The loader's position: restore it with ``load_state_dict()`` on a loader built the
        same way, and its next epoch goes on exactly after the last batch handed out here."""
        current = self._current() if self._current is not None else None
        if current is not None and not current.finished:
            began = time.perf_counter()
            state = current.state_dict()
            run = current._run
            if run is not None:  # on the timeline, when one is recorded
                run.runtime.note_span(Span.SAVE, began, time.perf_counter())
            return state
        if self._restore is not None:
            return dict(self._restore)
        start = capture_start(self, self._base_seed, not (self.persistent_workers and self._base_seed is not None))
        carried = self._keep.carry if self.persistent_workers else None
        if self._workers_now == 0 and has_state(self.dataset):
            # Without workers the dataset itself goes from epoch to epoch, as a persistent
            # worker's replica does: its state now (after the last epoch's end) starts the next.
            state = snapshot(self.dataset)
            if type(state) is StateFailure:
                warn_state_failed(self._keep, type(self.dataset).__name__, state[0])
                carried = None
            else:
                carried = {0: (0, state)}
        return loader_state.between(self, start, carried)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume ``state_dict`` (from ``state_dict()`` of a loader built the same way) with
        the next ``iter()``. A state of another dataset length, batch size, seeding or
        dataset kind is a ``ValueError``, and so is one of another worker count unless both
        loaders use ``seeding="batch"`` (docs/elastic-workers.md). A state of one rank of a
        ``DistributedSampler`` (or Accelerate's ``BatchSamplerShard``) run restores each rank
        of a run at another world size."""
        auto = self._keep.auto
        if auto is not None and isinstance(state_dict, dict):
            recorded = state_dict.get("shape", {}).get("num_workers")
            if isinstance(recorded, int) and recorded >= 1:
                auto.count = recorded  # resumed at the count it was taken with; "auto" goes on from there
        self._restore = loader_state.check(self, state_dict)
        self._current = None  # state_dict() now reports the loaded state, until the next iter()
        run, self._keep.run = self._keep.run, None
        if run is not None:  # persistent workers seeded for another run: the restore starts its own
            run.stop()
            self._base_seed = None


def _check_auto_fits(loader: DataLoader[Any]) -> None:
    """num_workers="auto" changes the count inside an epoch by dealing what is left of it
    anew: the epoch must be a list of index batches drawn here."""
    from .iterator import has_len

    if loader._dataset_kind == _DatasetKind.Iterable:
        raise ValueError(
            "num_workers='auto' needs a map-style dataset: an iterable dataset shards itself by the worker "
            "count (get_worker_info()), so its workers cannot change inside an epoch. Pass a fixed num_workers"
        )
    if not has_len(loader._index_sampler):
        raise ValueError(
            "num_workers='auto' needs a sampler with len(): the epoch's batches are dealt anew when the count "
            "changes, and a sampler without an end has no list of them. Pass a fixed num_workers"
        )


def _is_auto(num_workers: Any) -> bool:
    if isinstance(num_workers, AutoCount):
        return True
    if isinstance(num_workers, str):
        if num_workers != AUTO:
            raise ValueError(f"num_workers must be an int >= 0 or 'auto', got {num_workers!r}")
        return True
    return False


def _length_or_none(loader: DataLoader[Any]) -> int | None:
    # len() of a loader over an iterable dataset records that the length was asked, for
    # torch's warning when an epoch yields more: only the user's own call may count.
    said = loader._IterableDataset_len_called
    try:
        return len(loader)
    except TypeError:
        return None
    finally:
        loader._IterableDataset_len_called = said
