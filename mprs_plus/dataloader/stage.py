"""What a worker runs for ``mprs_plus.DataLoader``: torch's worker protocol as one DataPipe.

    main process                                   worker w (one LoaderStage replica)
    epoch's index batches, dealt round-robin  --Reset(WorkerEpoch w)-->  seed, worker info,
    (batch i to worker i % N)                                            worker_init_fn (first
                                                                         epoch of the process)
                                                                         fetch + collate each
                                                                         index batch --> lane

``LoaderStage`` is the worker segment of the loader's plan: the runtime replicates it in each
worker and iterates it every epoch. The epoch's work arrives in the runtime's per-epoch
reset: ``WorkerEpoch`` holds one worker's share of the index batches (map-style) or nothing
(an iterable dataset, whose replica yields its own batches), and applies torch's seeding
when the process starts. Batches are made by torch's own fetchers (``__getitems__``,
``collate_fn``, ``drop_last``, its iterable-dataset auto-collation), so they are torch's.

Seeding, as torch's worker loop does it: ``random`` and ``torch`` with ``base_seed + w``,
numpy's global generator with ``_generate_state(base_seed, w)``, then
``get_worker_info()`` is set and ``worker_init_fn(w)`` runs; a process is seeded once, so
persistent workers carry their generators' states across epochs, as torch's do.
With ``seeding="batch"`` (``WorkerEpoch.seeds``) each batch is also seeded, just before it is
made, from its place in the epoch (``batch_seeds.py``), so nothing a worker drew before
matters: a restore or a replacement skips what the loop has without reading it again.

The stage keeps everything heavy (the dataset, the collate function) in a plain holder
(``_Job``): graph walks (ours, and torch's ``traverse_dps``, which pickles what it walks)
see one DataPipe and nothing behind it.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import operator
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterDataPipe, MapDataPipe, graph_settings
from torch.utils.data._utils import worker as torch_worker
from torch.utils.data.dataloader import _DatasetKind

from ..runtime import generators
from ..transport import streaming


class _Job:
    """What every replica needs, set once per loader: not a DataPipe, not a collection."""

    __slots__ = ("dataset", "kind", "auto_collation", "collate_fn", "drop_last", "batch_size", "worker_init_fn", "snapshot_every")

    def __init__(
        self,
        dataset: Any,
        kind: int,
        auto_collation: bool,
        collate_fn: Any,
        drop_last: bool,
        batch_size: int | None,
        worker_init_fn: Any,
        snapshot_every: int,
    ) -> None:
        self.dataset = dataset
        self.kind = kind
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.batch_size = batch_size
        self.worker_init_fn = worker_init_fn
        self.snapshot_every = snapshot_every  # iterable datasets with state: every n batches (0: at the end only)

    def __getstate__(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        for name, value in zip(self.__slots__, state):
            setattr(self, name, value)


class BatchFailure(tuple):
    """A batch whose fetch or collate raised, in its place: ``(RemoteError,)``. As with
    torch's loader, the loop gets that exception at that batch's turn, and the epoch goes on
    with the next batches (the worker's stream does not end)."""

    __slots__ = ()


def failed_batch(exc: Exception, stage: LoaderStage) -> BatchFailure:
    from ..runtime.data_messages import RemoteError, describe_process
    from ..segment import Segment

    return BatchFailure((RemoteError.capture(exc, describe_process(Segment.WORKER, stage.worker_id)),))


class WithState(tuple):
    """A batch of a worker whose iterable dataset has state: ``(batch, worker, count, state)``,
    the dataset's ``state_dict()`` after the worker's ``count``-th batch of the epoch. The
    main process records the state and hands the batch on."""

    __slots__ = ()


class EndState(tuple):
    """What a worker whose iterable dataset has state sends once its iterator is exhausted:
    ``(worker, state)``, the dataset's ``state_dict()`` as the end of the epoch left it. Not
    a batch: the main process keeps it for the next epoch (persistent workers carry their
    datasets into it, and a state taken between epochs records them); a restore within the
    epoch never loads it (it may read as a fresh start, see ``EXHAUSTED``)."""

    __slots__ = ()


# The state of a replica whose dataset ended with its last batch: its ``state_dict()`` may
# already read as a fresh start (a dataset that resets at its end), so it is not asked.
EXHAUSTED = {"mprs_plus.DataLoader": "exhausted"}
# The state of an iterable dataset that is its own iterator (``__iter__`` returns self), kept
# under this key: it is the iterator's state, which ``__iter__`` may set up, so a restore
# loads it after ``iter()`` (torchdata's order), where any other is loaded before.
OWN_ITERATOR = "mprs_plus.DataLoader: its own iterator's state"
# An iterable dataset whose ``__iter__`` returns an iterator of its own with a state: the
# recorded state holds both, the dataset's (None without one) and the iterator's, mid-epoch
# (loaded into the epoch's iterator, after ``iter()``) or as an epoch ended (loaded into an
# iterator of its own before the next epoch's ``iter()``: what it sets beyond itself, such as
# a generator, carries into that epoch, as with torchdata's StatefulDataLoader).
DATASET = "mprs_plus.DataLoader: the dataset's state"
ITERATOR = "mprs_plus.DataLoader: its iterator's state"
ENDED_ITERATOR = "mprs_plus.DataLoader: its last epoch's iterator's state"


class StateFailure(tuple):
    """In place of a state: ``(text,)``, what ``state_dict()`` (or copying its result)
    raised. The epoch goes on; the main process warns once and restores that worker by
    replaying its epoch from the start, as for a dataset without state."""

    __slots__ = ()


def separate_iterator(dataset: Any, fetcher: Any) -> Any:
    """The epoch's iterator of an iterable dataset when it is an object of its own with a
    state (torchdata's ``Stateful``); else None."""
    iterator = getattr(fetcher, "dataset_iter", None)
    if iterator is None or iterator is dataset or not has_state(iterator):
        return None
    return iterator


def takes_state(dataset: Any, fetcher: Any) -> bool:
    """Whether a replica's state is recorded: its dataset's, or its epoch's iterator's."""
    return has_state(dataset) or separate_iterator(dataset, fetcher) is not None


def dataset_state(dataset: Any, fetcher: Any) -> Any:
    """The replica's state mid-epoch, as ``LoaderStage.begin`` loads it."""
    if getattr(fetcher, "ended", False):
        return EXHAUSTED
    iterator = separate_iterator(dataset, fetcher)
    if iterator is not None:
        return _with_iterator(ITERATOR, dataset, iterator)
    state = snapshot(dataset)
    if getattr(fetcher, "dataset_iter", None) is dataset and type(state) is not StateFailure:
        return {OWN_ITERATOR: state}
    return state


def end_state(dataset: Any, fetcher: Any) -> Any:
    """The replica's state as its epoch's iterator was exhausted: what the next epoch
    starts from."""
    iterator = separate_iterator(dataset, fetcher)
    if iterator is not None:
        return _with_iterator(ENDED_ITERATOR, dataset, iterator)
    return snapshot(dataset)


def _with_iterator(key: str, dataset: Any, iterator: Any) -> Any:
    state = snapshot(iterator)
    own = snapshot(dataset) if has_state(dataset) else None
    for part in (state, own):
        if type(part) is StateFailure:
            return part
    return {DATASET: own, key: state}


def snapshot(dataset: Any) -> Any:
    """The dataset's ``state_dict()`` as it is now, or a ``StateFailure`` where that
    raised: a state is taken for the user's checkpoints, and must never break the
    iteration itself. A copy: a dataset may return its live containers, which its next
    samples change, while the state waits in a message to be sent, or in the user's hands
    to be saved."""
    try:
        return copy.deepcopy(dataset.state_dict())
    except Exception as exc:  # user code
        return StateFailure((f"{type(exc).__name__}: {exc}",))


def _own_iterator_state(state: Any) -> bool:
    return type(state) is dict and len(state) == 1 and OWN_ITERATOR in state


def has_state(dataset: Any) -> bool:
    """torchdata's ``Stateful``: ``state_dict()`` and ``load_state_dict()``, the first
    callable without arguments. A ``state_dict()`` that needs some (litdata's and Mosaic's
    streaming datasets take the sample count and the loader's shape, for loaders of their
    own) is not this protocol: torch's loader never calls it, and neither does this one;
    such a dataset restores by replay."""
    state_dict = getattr(dataset, "state_dict", None)
    if not callable(state_dict) or not callable(getattr(dataset, "load_state_dict", None)):
        return False
    try:
        parameters = inspect.signature(state_dict).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): taken as the protocol's
        return True
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters)


def seed_worker(base_seed: int, worker_id: int) -> int:
    """torch's seeding of worker ``worker_id``: ``random``, ``torch``, numpy's global generator."""
    from ..runtime.child.seeding import seed_numpy  # numpy.random seeded now, or when first imported

    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    if torch_worker.HAS_NUMPY:
        seed_numpy(torch_worker._generate_state(base_seed, worker_id))
    return seed


def collate_tensors_privately() -> None:
    """In this worker process, have ``default_collate`` stack tensors into the memory that
    crosses to the main process, or else into ordinary memory.

    In a worker, torch's collate stacks a batch into a new torch shared-memory storage
    (a file of ``/dev/shm``) so that its own queues pass it on without a copy. Here a
    large batch (``LEND_MIN`` bytes or more, of elements of 16 KiB or more: see
    ``_IN_PLACE_ELEMENT``) is stacked straight into an extent of the
    worker's output channel's lend area (``_stack_into_channel``), which the channel then
    publishes without copying it; any other goes to ordinary memory, which the channel
    copies as it copies any item: a ``/dev/shm`` file would cost a second copy, and room
    that a container may not have. Same values, same checks (torch's own function runs,
    without the worker-only branch, wherever the batch is not built in place); a collate
    function a user put in ``default_collate_fn_map`` stays. Batches of plain ints and
    floats are made as torch makes them, through numpy (``_collate_ints``): the same
    tensors, at less than half the cost."""
    from torch.utils.data._utils import collate

    if collate.default_collate_fn_map.get(torch.Tensor) is collate.collate_tensor_fn:
        collate.default_collate_fn_map[torch.Tensor] = _collate_tensors
    if collate.default_collate_fn_map.get(int) is collate.collate_int_fn:
        collate.default_collate_fn_map[int] = _collate_ints
    if collate.default_collate_fn_map.get(float) is collate.collate_float_fn:
        collate.default_collate_fn_map[float] = _collate_floats


def _collate_tensors(batch: Any, *, collate_fn_map: Any = None) -> Any:
    from torch.utils.data._utils import collate

    stacked = _stack_into_channel(batch)
    if stacked is not None:
        return stacked
    info, torch_worker._worker_info = torch_worker._worker_info, None  # torch's worker-only branch off
    try:
        return collate.collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    finally:
        torch_worker._worker_info = info


def _collate_ints(batch: Any, *, collate_fn_map: Any = None) -> Any:
    """torch's ``collate_int_fn`` (``torch.tensor(batch)``) for a batch of plain ints, at
    less than half its cost: a batch of 64 ints took a quarter of a worker's time in
    ``torch.tensor``. The same tensor: int64 (a ``bool`` after a first ``int`` is 0 or 1 in
    torch's too), in a storage of torch's own. Anything else (a first ``bool``, an int subclass,
    another type among them, an int outside int64) takes torch's function, which makes
    what it makes or raises its own error."""
    from torch.utils.data._utils import collate

    if type(batch[0]) is int and set(map(type, batch)) <= _INT_TYPES:
        out = _filled(batch, np.int64)
        if out is not None:
            return out
    return collate.collate_int_fn(batch, collate_fn_map=collate_fn_map)


def _collate_floats(batch: Any, *, collate_fn_map: Any = None) -> Any:
    """torch's ``collate_float_fn`` (``torch.tensor(batch, dtype=torch.float64)``) for a
    batch of plain floats, as ``_collate_ints`` does for ints; anything else takes torch's."""
    from torch.utils.data._utils import collate

    if len(set(map(type, batch))) == 1 and type(batch[0]) is float:
        out = _filled(batch, np.float64)
        if out is not None:
            return out
    return collate.collate_float_fn(batch, collate_fn_map=collate_fn_map)


_INT_TYPES = frozenset((int, bool))


def _filled(batch: Any, dtype: Any) -> torch.Tensor | None:
    """A new 1-d tensor of numpy ``dtype`` holding ``batch``'s numbers, read by numpy and
    copied into a storage of torch's own (resizable, as ``torch.tensor``'s); None where
    numpy refuses one (an int outside int64)."""
    try:
        numbers = np.fromiter(batch, dtype=dtype, count=len(batch))
    except (OverflowError, TypeError, ValueError):
        return None
    return torch.from_numpy(numbers).clone()


# Bytes; a smaller batch is stacked in ordinary memory (the transport copies it anyway).
_IN_PLACE_MIN = 128 << 10  # the transport's LEND_MIN
# Bytes of one element; a batch of smaller ones is stacked in ordinary memory too. Building
# in place costs about 13 us a batch (the borrowed extent, the views over it) and 0.12 us
# an element (its type and dtype checked); the copy it saves, 0.03 to 0.1 us a KiB. A
# batch of 128 rows of 1 KiB lost by it: 300-340k samples/s in place, 330-364k copied,
# 13 fresh processes each (docs/benchmarks.md, Cheap samples). From 16 KiB an element
# the copy saved is several times the checks.
_IN_PLACE_ELEMENT = 16 << 10


def _stack_into_channel(batch: Sequence[Any]) -> torch.Tensor | None:
    """``torch.stack(batch)`` built in memory the worker's output channel lends it
    (``borrow_for_current_lane``), or None where torch's own path must make it: a batch
    under ``_IN_PLACE_MIN`` bytes, anything but plain CPU tensors of one type, dtype and
    shape, the first contiguous (nested, sparse, other layouts, subclasses, autograd,
    conjugate or negative bits on the first), a thread that runs no lane, or no room in
    the channel. The result is
    torch's, value for value: contiguous, of the elements' dtype, ``(len(batch), *shape)``.

    The buffer goes back to the channel when the tensor is sent and read, or when it dies
    unsent (a collate function that raises later, a batch dropped): the transport ties it
    to the buffer's lifetime, and ``torch.frombuffer`` keeps the buffer alive with it."""
    from ..runtime.child.lanes import borrow_for_current_lane

    first = batch[0]
    if first.is_nested or first.layout is not torch.strided:
        return None  # torch's path raises its own error for these
    # The size first: most batches are small, and checking each element costs more than
    # the copy it would save. So do batches of many small elements (see _IN_PLACE_ELEMENT).
    element = first.numel() * first.element_size()
    nbytes = len(batch) * element
    if nbytes < _IN_PLACE_MIN or element < _IN_PLACE_ELEMENT:
        return None
    kind, dtype, shape = type(first), first.dtype, first.shape
    if (
        kind is not torch.Tensor  # a subclass keeps torch's path, which knows how to make one
        or first.device.type != "cpu"
        or first.requires_grad
        or first.is_quantized
        or first.is_conj()
        or first.is_neg()
        or not first.is_contiguous()
    ):
        return None
    # The others: the same type and dtype as the first, each compared in one C loop (a
    # Python check per element cost a batch of 128 small rows a third of its stack). So
    # none is quantized either. torch.stack itself refuses every other difference into an
    # ``out`` (a shape, a device, autograd, a sparse, nested or mkldnn one): then torch's
    # path runs, and raises its own error or makes what it makes. A later non-contiguous
    # element changes nothing: with the first contiguous, torch's result is contiguous too,
    # and conjugate or negative bits are resolved by either stack alike.
    if len(set(map(type, batch))) != 1 or len(set(map(_dtype_of, batch))) != 1:
        return None
    buffer = borrow_for_current_lane(nbytes)
    if buffer is None:
        return None
    streamed = streaming.streams(element) and _stream_into(buffer, batch, element)
    out = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(len(batch), *shape)
    del buffer  # the tensor holds it now: the extent lives exactly as long as the tensor
    if streamed:
        return out
    try:
        return torch.stack(batch, 0, out=out)
    except Exception:  # a difference above: the extent goes back with ``out``
        return None


def _stream_into(buffer: Any, batch: Sequence[torch.Tensor], element: int) -> bool:
    """``torch.stack(batch)``'s bytes written into ``buffer`` with streaming stores
    (``transport/streaming.py``: the main process reads them, this worker never does),
    where every element is one torch would copy as it is: of the first's shape (type and
    dtype are checked already), contiguous, on the CPU, strided, without autograd or
    conjugate or negative bits. False, with nothing written, where one is not:
    ``torch.stack`` then makes the batch (or refuses it)."""
    shape = batch[0].shape
    for sample in batch:
        if (
            sample.layout is not torch.strided  # first: shape and is_contiguous raise on some others
            or sample.is_nested
            or sample.shape != shape
            or not sample.is_contiguous()
            or sample.device.type != "cpu"
            or sample.requires_grad
            or sample.is_conj()
            or sample.is_neg()
        ):
            return False
    copy = streaming.copy_from_address
    for place, sample in enumerate(batch):
        copy(buffer, place * element, sample.data_ptr(), element)
    return True


_dtype_of = operator.attrgetter("dtype")


class LoaderStage(IterDataPipe):
    """One worker's replica of the loader: fetches and collates its share of each epoch."""

    def __init__(self, job: _Job) -> None:
        self.job = job
        self.worker_id = 0
        self.num_workers = 1
        self._seeded = False
        self._epoch: WorkerEpoch | None = None
        self._fetcher: Any = None
        self._dataset_state: Any = None

    def __deepcopy__(self, memo: dict[int, Any]) -> LoaderStage:
        # The runtime copies a worker segment before handing it to the workers; the copy
        # shares the job: a dataset is never copied in this process (it may be large, or
        # hold objects shared with the workers, such as locks), as torch's loader hands
        # its own to its workers.
        return LoaderStage(self.job)

    def apply_sharding(self, num_instances: int, instance_id: int, sharding_group: Any = None) -> None:
        """The worker's shard is its share of the index batches (map-style), set each epoch;
        an iterable dataset shards itself with ``get_worker_info()``, as with torch."""
        self.worker_id, self.num_workers = instance_id, num_instances

    def __len__(self) -> int:
        epoch = self._epoch
        if epoch is None or epoch.batches is None:
            raise TypeError("this epoch's batches are made as they come: they have no len()")
        return len(epoch.batches)

    def begin(self, epoch: WorkerEpoch, in_worker: bool = True) -> None:
        """The runtime's per-epoch reset, in the worker: seed the process once, then set
        up this epoch's fetcher (an iterable dataset's ``iter()`` is taken here, as torch's
        worker does when an epoch begins). ``in_worker=False``: the main process itself
        (``num_workers=0``), which torch does not seed."""
        job = self.job
        self.worker_id, self.num_workers = epoch.worker_id, epoch.num_workers
        if epoch.shared_seed is not None and isinstance(job.dataset, IterDataPipe):
            shared = torch.Generator()
            shared.manual_seed(epoch.shared_seed)
            job.dataset = graph_settings.apply_random_seed(job.dataset, shared)
        if not in_worker and not self._seeded and isinstance(job.dataset, (IterDataPipe, MapDataPipe)):
            self._seeded = True  # torch's single process shards a DataPipe across ranks once
            graph_settings.apply_sharding(job.dataset, *epoch.distributed)
        if in_worker and not self._seeded:
            self._seeded = True
            seed = seed_worker(epoch.base_seed, epoch.worker_id)
            torch_worker._worker_info = torch_worker.WorkerInfo(
                id=epoch.worker_id, num_workers=epoch.num_workers, seed=seed, dataset=job.dataset
            )
            collate_tensors_privately()
            if isinstance(job.dataset, (IterDataPipe, MapDataPipe)):  # torch's DataPipe sharding
                world_size, rank = epoch.distributed
                graph_settings.apply_sharding(
                    job.dataset, epoch.num_workers * world_size, epoch.worker_id * world_size + rank
                )
            if job.worker_init_fn is not None:
                job.worker_init_fn(epoch.worker_id)
        restored = generators.dataset_restore()
        if restored is not None:
            # A replacement of a dead worker: the dataset's state recorded, with the
            # generators, after that many of its batches (``runtime/generators.py``).
            epoch.state_count, epoch.dataset_state = restored
        self._epoch = epoch
        self._fetcher = None
        state = epoch.dataset_state
        after_iter = _own_iterator_state(state)
        with_iterator = type(state) is dict and DATASET in state
        if with_iterator:
            if state[DATASET] is not None:
                job.dataset.load_state_dict(state[DATASET])
        elif state is not None and state != EXHAUSTED and not after_iter:
            job.dataset.load_state_dict(state)  # a restore: the dataset as it was recorded
        if job.kind == _DatasetKind.Iterable:
            if with_iterator and ENDED_ITERATOR in state:
                # The last epoch's iterator as it ended, made again: loading it sets what it
                # set beyond itself (a generator); the epoch's own iterator comes next.
                iter(job.dataset).load_state_dict(state[ENDED_ITERATOR])
            self._fetcher = make_fetcher(job)  # iter(dataset): once per epoch, restored or not
            if after_iter:
                self._fetcher.dataset_iter.load_state_dict(state[OWN_ITERATOR])
            elif with_iterator and ITERATOR in state:
                self._fetcher.dataset_iter.load_state_dict(state[ITERATOR])
            self._fetcher.ended = state == EXHAUSTED

    @property
    def skips_lost(self) -> bool:
        """Whether ``resume_from`` can leave one batch out (``lost``): a map-style dataset's
        batches are known by their indices, an iterable dataset's only by making them."""
        return self.job.kind == _DatasetKind.Map

    def resume_from(self, skip: int, lost: int = -1) -> Iterator[Any]:
        """The runtime's restore hook: this epoch's stream after its first ``skip`` batches.
        Map-style: the samples of the skipped batches are read again and dropped (through
        the user's collate function, if any: ``replay``), so that whatever ``__getitem__``
        and the collate function draw from the worker's generators is drawn again and the
        batches after them are the uninterrupted run's; a dataset with a recorded state (set in ``begin``) replays only the batches after it. An iterable
        dataset goes on from its recorded state and replays only the batches after it.
        ``lost`` (map-style): the position of a batch whose samples killed the worker that
        read them twice; its samples are not read again."""
        epoch = self._epoch
        if epoch is None:
            raise RuntimeError("internal error: a loader stage resumed before its epoch began")
        done = epoch.state_count  # batches the recorded dataset state already covers
        # A replacement of a dead worker: its generators were loaded as they stood after
        # that many batches (``runtime/generators.py``), with its dataset's state if it has one.
        done = max(done, generators.jump_to())
        if epoch.seeds is not None and not has_state(self.job.dataset):
            # seeding="batch": each batch seeds the generators itself, so nothing before it
            # needs reading again (a dataset with a state of its own still does).
            done = max(done, skip)
        if epoch.batches is not None:
            replay(self.job, _without(enumerate(epoch.batches[done:skip], done), lost))
            return _map_batches(self, epoch.batches[skip:], skip, len(epoch.batches), places(epoch, skip))
        if epoch.sampler is not None:
            share = own_share(epoch, *epoch.sampler)
            replay(self.job, _without(enumerate(itertools.islice(share, done, skip), done), lost))
            return _map_batches(self, share, skip, None, places(epoch, skip))
        return _iterable_batches(self, skip - epoch.state_count, epoch.state_count)


def _without(numbered: Iterable[tuple[int, Any]], lost: int) -> Iterator[Any]:
    return (batch for position, batch in numbered if position != lost)


def make_fetcher(job: _Job) -> Any:
    return _DatasetKind.create_fetcher(job.kind, job.dataset, job.auto_collation, job.collate_fn, job.drop_last)


def _dropped(samples: Any) -> None:
    return None


def replay(job: _Job, batches: Iterable[Any]) -> None:
    """Read the samples of ``batches`` of a map-style dataset and drop them (a restore).

    torch's own collate functions draw nothing and are left out; a collate function of the
    user's runs, its batch dropped: it may draw from the generators (a collator that masks
    tokens at random does), and the batches after these must see the draws it made."""
    from torch.utils.data._utils.collate import default_collate, default_convert

    collate = _dropped if job.collate_fn in (default_collate, default_convert) else job.collate_fn
    fetch = _DatasetKind.create_fetcher(job.kind, job.dataset, job.auto_collation, collate, job.drop_last).fetch
    for indices in batches:
        fetch(indices)


def own_share(epoch: WorkerEpoch, sampler: Any, rng_state: Any) -> Iterator[Any]:
    """This worker's index batches (i % N == w) of a sampler without ``len()``, drawn from
    the worker's copy of it. Its draws from torch's global generator are made with the
    main process's generator as the epoch left it (``rng_state``), kept apart from the
    worker's own generator, which the samples draw from: every worker's copy yields the
    batches the main process's sampler would have yielded, one at a time, so an
    infinite sampler is no list."""
    batches = iter(sampler)
    main_state = rng_state
    number = 0
    while True:
        own_state = torch.get_rng_state()
        torch.set_rng_state(main_state)
        try:
            indices = next(batches)
        except StopIteration:
            return
        finally:
            main_state = torch.get_rng_state()
            torch.set_rng_state(own_state)
        if number % epoch.num_workers == epoch.worker_id:
            yield indices
        number += 1


def places(epoch: WorkerEpoch, skip: int = 0) -> Iterator[int] | None:
    """``seeding="batch"``: the epoch positions of the worker's batches from its ``skip``-th
    on (its own, or every num_workers-th from its id); None with torch's seeding."""
    if epoch.seeds is None:
        return None
    if epoch.positions is not None:
        return iter(epoch.positions[skip:])
    return itertools.count(epoch.worker_id + skip * epoch.num_workers, epoch.num_workers)


def _map_batches(
    stage: LoaderStage, batches: Iterable[Any], count: int = 0, total: int | None = None, at: Iterator[int] | None = None
) -> Iterator[Any]:
    """Fetch and collate each index batch; a dataset with ``state_dict()`` sends its state
    along every ``snapshot_every`` batches and with the worker's last one (its state at
    the epoch's end, which persistent workers carry into the next). ``at``: each batch's
    place in the epoch, whose seeds it is made with (``seeding="batch"``)."""
    job = stage.job
    seeds = stage._epoch.seeds if stage._epoch is not None and at is not None else None
    fetch = make_fetcher(job).fetch
    stateful = has_state(job.dataset)
    every = job.snapshot_every
    # A batch depends on its indices, the generators and the dataset's state, where it has one.
    note = generators.note
    recorded = _recorded(lambda: snapshot(job.dataset)) if stateful else None
    position = count
    for indices in batches:
        position += 1
        if seeds is not None:
            seeds.apply(next(at))  # type: ignore[arg-type]
        try:
            batch = fetch(indices)
        except Exception as exc:  # user code: that batch's error, and the epoch goes on
            count += 1
            note(position, recorded)
            yield failed_batch(exc, stage)
            continue
        note(position, recorded)
        if not stateful:
            yield batch
            continue
        count += 1
        if (every and count % every == 0) or count == total:
            state = snapshot(job.dataset)
            stateful = type(state) is not StateFailure  # once it raised, not again this epoch
            yield WithState((batch, stage.worker_id, count, state))
        else:
            yield batch


def _iterable_batches(stage: LoaderStage, replay: int = 0, count: int = 0) -> Iterator[Any]:
    """The replica's batches, as torch's iterable fetcher makes them; a dataset with state
    sends its ``state_dict()`` along every ``snapshot_every`` batches. The first ``replay``
    batches are made and dropped (a restore without a recorded state for them)."""
    job, fetcher = stage.job, stage._fetcher
    request = [None] * job.batch_size if job.auto_collation else None
    stateful = takes_state(job.dataset, fetcher)
    every = job.snapshot_every
    # With a state, a batch depends on it and the generators: a replacement starts from a record.
    note = generators.note if stateful else None
    recorded = _recorded(lambda: dataset_state(job.dataset, fetcher))
    epoch = stage._epoch
    seeds = epoch.seeds if epoch is not None else None
    while True:
        if seeds is not None:  # a replica's batches are its own: numbered in its stream
            seeds.apply(count, stage.worker_id)
        try:
            batch = fetcher.fetch(request)
        except StopIteration:
            if stateful:
                yield EndState((stage.worker_id, end_state(job.dataset, fetcher)))
            return
        except Exception as exc:  # the dataset's iterator raised: that batch's error; a
            count += 1  # generator that raised is done, and the next fetch ends the stream
            if replay <= 0:
                yield failed_batch(exc, stage)
            else:
                replay -= 1
            continue
        count += 1
        if note is not None:
            note(count, recorded)
        if replay > 0:
            replay -= 1
            continue
        if stateful and ((every and count % every == 0) or fetcher.ended):
            state = dataset_state(job.dataset, fetcher)
            stateful = type(state) is not StateFailure  # once it raised, not again this epoch
            yield WithState((batch, stage.worker_id, count, state))
        else:
            yield batch


def _recorded(take: Callable[[], Any]) -> Callable[[], Any]:
    """``take()``, a state as a restore loads it, for a record of a dead worker's replacement
    (``runtime/generators.py``); a ``StateFailure`` raises there, and is not recorded."""

    def state() -> Any:
        found = take()
        if type(found) is StateFailure:
            raise RuntimeError(found[0])
        return found

    return state


def _iterate_stage(stage: LoaderStage) -> Iterator[Any]:
    epoch = stage._epoch
    if epoch is None:
        raise RuntimeError("internal error: a loader stage iterated before its epoch began")
    if epoch.batches is not None:
        return _map_batches(stage, epoch.batches, 0, len(epoch.batches), places(epoch))
    if epoch.sampler is not None:
        return _map_batches(stage, own_share(epoch, *epoch.sampler), 0, None, places(epoch))
    return _iterable_batches(stage, 0, epoch.state_count)


# Assigned after the class is made, as the runtime's own readers are: torch's DataPipe
# metaclass wraps an ``__iter__`` of the class body with per-item bookkeeping.
LoaderStage.__iter__ = _iterate_stage  # type: ignore[method-assign]


class WorkerEpoch:
    """One worker's part of an epoch, sent in the runtime's reset; applied to the stage."""

    __slots__ = (
        "worker_id", "num_workers", "base_seed", "batches", "dataset_state", "state_count", "sampler", "shared_seed",
        "distributed", "seeds", "positions",
    )

    def __init__(
        self,
        worker_id: int,
        num_workers: int,
        base_seed: int,
        batches: list[Any] | None,
        dataset_state: Any = None,
        state_count: int = 0,
        sampler: tuple[Any, Any] | None = None,
        shared_seed: int | None = None,
        distributed: tuple[int, int] = (1, 0),
        seeds: Any = None,
        positions: Sequence[int] | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.num_workers = num_workers
        self.base_seed = base_seed
        self.batches = batches  # None: an iterable dataset
        self.dataset_state = dataset_state  # a restore: the replica's recorded state ...
        self.state_count = state_count  # ... after this many of its batches
        # A sampler without len(): (the index sampler, torch's global generator state as
        # the epoch's base seed left it); its batches are drawn in the worker (own_share).
        self.sampler = sampler
        self.shared_seed = shared_seed  # a DataPipe dataset: seeds its random DataPipes, as torch does
        self.distributed = distributed  # (world size, rank) when the epoch began
        self.seeds = seeds  # seeding="batch": a BatchSeeds, each batch seeded from its place
        self.positions = positions  # ... its batches' places in the epoch (None: i * N + w)

    def __getstate__(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        for name, value in zip(self.__slots__, state):
            setattr(self, name, value)

    def __call__(self, stage: LoaderStage) -> LoaderStage:
        stage.begin(self)
        return stage


class EpochOrders:
    """The per-epoch reset function for all workers: ``for_worker(w)`` is worker w's part
    (the runtime asks for it, so each worker receives only its own share)."""

    def __init__(self, parts: Sequence[WorkerEpoch]) -> None:
        self.parts = list(parts)

    def for_worker(self, worker: int) -> WorkerEpoch:
        return self.parts[worker]
