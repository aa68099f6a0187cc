"""How the main process draws an epoch, exactly as torch's DataLoader does, and again on restore.

torch's ``_BaseDataLoaderIter`` takes the sampler's iterator, then draws the workers' base
seed from the loader's ``generator`` (or torch's global generator), and only then advances
the sampler (``RandomSampler`` draws its own seed on its first step). Persistent workers
draw the base seed once, with their first epoch. ``draw_epoch`` keeps that order, so the
main process's generators advance as torch's do and the epoch's index batches and seeds
are torch's.

A checkpoint does not store the epoch's indices: it stores what drew them (``EpochStart``,
taken once per epoch, before the first draw): the generator's state (or the global one's
when there is no generator), and the state of a sampler with ``state_dict()``. A restore
sets them back and draws the same epoch again.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.utils.data
from torch.utils.data import IterDataPipe


class EpochStart(NamedTuple):
    """What the epoch's draws start from (taken before them), and the base seed."""

    generator_state: list[int]  # the loader's generator's, or torch's global generator's without one (bytes)
    samplers: tuple[Any, ...]  # ``state_dict()`` of the sampler and of the batch sampler (None: none)
    base_seed: int | None  # the epoch's base seed, once drawn or inherited
    draws_base_seed: bool  # False: persistent workers already have theirs
    epoch: int = 0  # the loader's epoch number, counted from its first iter() (seeding="batch")

    def to_dict(self) -> dict[str, Any]:
        return self._asdict()

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> EpochStart:
        return cls(
            list(state["generator_state"]), tuple(state["samplers"]), state["base_seed"], state["draws_base_seed"],
            int(state.get("epoch", 0)),
        )


def samplers_of(loader: Any) -> tuple[Any, Any]:
    return loader.sampler, loader.batch_sampler


def _state_of(sampler: Any) -> Any:
    """A copy (the epoch's draws change a sampler that hands out its live containers) of
    the sampler's state, torchdata's ``Stateful`` only; None without one, or where its
    ``state_dict()`` raised: the epoch goes on, and a restore draws its order again."""
    from .stage import StateFailure, has_state, snapshot

    if not has_state(sampler):
        return None
    state = snapshot(sampler)
    if type(state) is StateFailure:
        from ..user_frame import warn

        warn(
            f"{type(sampler).__name__}.state_dict() raised {state[0]}. The batches go on; this DataLoader's "
            "states hold no state of that sampler (a restore draws its order again from the generator)"
        )
        return None
    return state


def capture_start(loader: Any, base_seed: int | None, draws_base_seed: bool) -> EpochStart:
    generator = loader.generator
    state = generator.get_state() if generator is not None else torch.get_rng_state()
    # Plain ints, once per epoch: a state is JSON as well as torch.save material.
    return EpochStart(
        state.tolist(), tuple(_state_of(s) for s in samplers_of(loader)), base_seed, draws_base_seed, getattr(loader, "_epoch", 0)
    )


def set_start(loader: Any, start: EpochStart) -> None:
    """Set back what the epoch's draws start from (a restore)."""
    state = torch.tensor(start.generator_state, dtype=torch.uint8)
    if loader.generator is not None:
        loader.generator.set_state(state)
    else:
        torch.set_rng_state(state)
    for sampler, state in zip(samplers_of(loader), start.samplers):
        if state is not None:
            sampler.load_state_dict(state)


def _draw(generator: Any) -> int:
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def draw_epoch(loader: Any, start: EpochStart) -> tuple[int, int | None, Iterator[Any]]:
    """The epoch's base seed, a DataPipe dataset's shared seed (else None) and the index
    sampler's iterator, drawn in torch's order: a new iterator draws the shared seed, then
    the base seed (and with workers one more shared seed, which torch's first reset draws
    and never uses); persistent workers' later epochs only a new shared seed."""
    datapipe = isinstance(loader.dataset, IterDataPipe)
    shared_seed = _draw(loader.generator) if datapipe and start.draws_base_seed else None
    indices = iter(loader._index_sampler)
    if start.draws_base_seed:
        base_seed = _draw(loader.generator)
        if datapipe and getattr(loader, "_workers_now", loader.num_workers) > 0:
            _draw(loader.generator)
    else:
        base_seed = start.base_seed  # type: ignore[assignment]
        if datapipe:
            shared_seed = _draw(loader.generator)
    return base_seed, shared_seed, indices


def draw_batches(index_sampler: Any, indices: Iterator[Any]) -> Sequence[Any]:
    """Every index batch of the epoch, drawn now: ``list(indices)``, the index sampler's
    iterator, not started yet.

    torch's own ``BatchSampler`` cuts its sampler's indices into consecutive runs of
    ``batch_size`` (the last one shorter, or dropped with ``drop_last``): for it the
    indices are drawn in one go and cut by slicing, the same batches at a fraction of the
    cost of a step per batch (an epoch of a million samples is drawn before its first
    batch, and that time is the loop's). The sampler starts where the batch sampler's
    first step would have started it, so its draws come in the same order. Over a
    ``SequentialSampler`` or a ``RandomSampler`` (every index a Python int) they are kept
    in one array (``IndexBatches``): a list per batch cost 0.13 s for 400,000 indices."""
    if type(index_sampler) is not torch.utils.data.BatchSampler:
        return list(indices)
    size = index_sampler.batch_size
    if type(index_sampler.sampler) in _INT_SAMPLERS:
        return IndexBatches(_packed(_drawn(index_sampler)), size)
    flat = list(index_sampler.sampler)
    end = len(flat) - len(flat) % size if index_sampler.drop_last else len(flat)
    return [flat[i : i + size] for i in range(0, end, size)]


def gather(batches: Sequence[Any], places: Sequence[int]) -> Sequence[Any]:
    """The batches at ``places`` (ascending), as compact as ``batches`` where it is an
    ``IndexBatches`` (only its last batch may be short: so is the gathered one's)."""
    if type(batches) is not IndexBatches or not places:
        return [batches[p] for p in places]
    count, size, flat = len(batches), batches._size, batches._flat
    if count - 1 in places[:-1]:  # the short last batch not last here: lists
        return [batches[p] for p in places]
    packed = array(flat.typecode)
    for p in places:
        packed += flat[p * size : (p + 1) * size]
    return IndexBatches(packed, size)


def deal_epoch(index_sampler: Any, indices: Iterator[Any], workers: int) -> list[Sequence[Any]]:
    """Every worker's share of the epoch's index batches, drawn now (``indices``: the
    index sampler's iterator, not started yet), dealt as torch deals them.

    Over torch's ``BatchSampler`` of a ``SequentialSampler`` or a ``RandomSampler`` (every
    index a Python int), each share is an ``IndexBatches``: its indices in one array. A
    list of lists costs about 40 bytes an index, in this process and in the worker, and
    freeing it here after the workers were forked touches every page it lies on, which
    the fork had made shared: the loop's first batch waited for those copies."""
    if type(index_sampler) is not torch.utils.data.BatchSampler or type(index_sampler.sampler) not in _INT_SAMPLERS:
        return deal(draw_batches(index_sampler, indices), workers)
    size = index_sampler.batch_size
    if type(index_sampler.sampler) is torch.utils.data.SequentialSampler:
        end = len(index_sampler.sampler)
        if index_sampler.drop_last:
            end -= end % size
        count = -(-end // size)
        return [StridedBatches(w, workers, len(range(w, count, workers)), size, end) for w in range(workers)]
    drawn = _drawn(index_sampler)
    end = len(drawn)
    whole = end // size  # batches of ``size``; one shorter follows where end is not a multiple
    batches = drawn[: whole * size].reshape(whole, size)
    shares = []
    for w in range(workers):
        mine = batches[w::workers].ravel()  # its batches w, w + workers, ... in one array
        if end % size and whole % workers == w:  # the short last batch, number ``whole``
            mine = np.concatenate((mine, drawn[whole * size : end]))
        shares.append(IndexBatches(_packed(mine), size))
    return shares


_INT_SAMPLERS = (torch.utils.data.SequentialSampler, torch.utils.data.RandomSampler)


def _drawn(index_sampler: Any) -> Any:
    """The epoch's indices in order, as an int64 array, from torch's ``BatchSampler`` over a
    ``SequentialSampler`` or ``RandomSampler`` (of exactly these types); with ``drop_last``
    without the short last batch's.

    A ``RandomSampler`` without replacement is drawn as its own ``__iter__`` draws, its
    permutations kept as tensors (``_permuted``): 600,000 shuffled indices cost about
    6 ms so, against 60-75 for reading its iterator, an int at a time, even in C (numpy's
    ``fromiter``), time that the epoch's first batch waits for. Any other is read through
    its iterator, which yields exactly ``len()`` indices; one more would still be kept."""
    sampler = index_sampler.sampler
    if type(sampler) is torch.utils.data.RandomSampler and not sampler.replacement and _permutes_as_torch():
        drawn = _permuted(sampler)
    else:
        indices = iter(sampler)
        drawn = np.fromiter(indices, np.int64, count=len(sampler))
        rest = list(indices)
        if rest:
            drawn = np.concatenate((drawn, np.array(rest, dtype=np.int64)))
    if index_sampler.drop_last:
        drawn = drawn[: len(drawn) - len(drawn) % index_sampler.batch_size]
    return drawn


def _permuted(sampler: Any) -> Any:
    """What ``RandomSampler.__iter__`` (without replacement) yields, as one int64 array,
    with the same draws: a seed from torch's global generator for a generator of its own
    where it has none, then one ``randperm`` of the data source's length per whole pass
    of ``num_samples`` and one more, cut, for the rest. The iterator's end draws that one
    even when nothing of it is kept: so is it here where the sampler's generator is the
    user's (its state after the epoch is torch's), not where it is one of its own, made
    here and dropped after, which nobody can see (a shuffled 600,000 rows: 6 ms less
    before each epoch's first batch)."""
    size = len(sampler.data_source)
    generator = sampler.generator
    own = generator is None
    if own:
        generator = torch.Generator()
        generator.manual_seed(_draw(None))
    count = sampler.num_samples
    passes = [torch.randperm(size, generator=generator) for _ in range(count // size)]
    if count % size or not own:
        passes.append(torch.randperm(size, generator=generator)[: count % size])
    return torch.cat(passes).numpy()


_checked_iter: list[Any] = [None, False]  # the RandomSampler.__iter__ checked, and whether _permuted draws as it does


def _permutes_as_torch() -> bool:
    """Whether ``_permuted`` draws what this process's ``RandomSampler.__iter__`` draws, the
    indices and the generators' states after, checked once per ``__iter__`` (a torch
    release that draws otherwise, or a patched sampler, takes the iterator's path)."""
    method = torch.utils.data.RandomSampler.__iter__
    if _checked_iter[0] is not method:
        _checked_iter[:] = [method, _same_draws()]
    return _checked_iter[1]


def _same_draws() -> bool:
    saved = torch.get_rng_state()
    try:
        for size, count, seeded in ((7, None, False), (5, 12, True), (6, 4, True), (3, 6, False)):
            results = []
            for fast in (False, True):
                torch.default_generator.manual_seed(11)  # the CPU generator alone: a device's stays as it is
                generator = torch.Generator().manual_seed(13) if seeded else None
                sampler = torch.utils.data.RandomSampler(range(size), num_samples=count, generator=generator)
                drawn = _permuted(sampler).tolist() if fast else list(sampler)
                after = generator.get_state() if seeded else torch.get_rng_state()
                results.append((drawn, after.tolist()))
            if results[0] != results[1]:
                return False
        return True
    except Exception:
        return False
    finally:
        torch.set_rng_state(saved)


def _packed(indices: Any) -> array:
    """``indices`` in one array: of 32-bit ints where they all fit (every dataset under 2**31
    samples), else 64-bit. A worker's share is pickled into its first message and read by
    a worker that has just started; half the bytes took 5-12 ms off the first batch of
    600,000 shuffled rows (2 workers: 1.2 MB a share rather than 2.4)."""
    indices = np.ascontiguousarray(indices, dtype=np.int64)
    narrow = not len(indices) or (int(indices.min()) >= _INT32.min and int(indices.max()) <= _INT32.max)
    packed = array("i" if narrow else "q")
    packed.frombytes((indices.astype(np.int32) if narrow else indices).view(np.uint8))
    return packed


_INT32 = np.iinfo(np.int32)


class IndexBatches(Sequence):  # type: ignore[type-arg]
    """A worker's index batches, compact: their indices in one ``array`` (``_packed``), every batch
    ``size`` long but the last. Reads as a list of lists of ints (a batch is a new list
    of Python ints, as the sampler yields them); a slice is another ``IndexBatches``."""

    __slots__ = ("_flat", "_size")

    def __init__(self, flat: array, size: int) -> None:
        self._flat = flat
        self._size = size

    def __reduce__(self) -> tuple[Any, ...]:
        return (IndexBatches, (self._flat, self._size))

    def __len__(self) -> int:
        return -(-len(self._flat) // self._size)

    def __getitem__(self, key: Any) -> Any:
        size = self._size
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            return IndexBatches(self._flat[start * size : max(start, stop) * size], size)
        number = operator.index(key)
        count = len(self)
        if number < 0:
            number += count
        if not 0 <= number < count:
            raise IndexError("index batch out of range")
        return self._flat[number * size : (number + 1) * size].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        flat, size = self._flat, self._size
        for start in range(0, len(flat), size):
            yield flat[start : start + size].tolist()


class StridedBatches(Sequence):  # type: ignore[type-arg]
    """A worker's share of a ``SequentialSampler``'s index batches, computed: its batch j is
    the epoch's batch ``first + j * step``, the indices ``range(b * size, (b + 1) * size)``
    cut at ``end``. Nothing is drawn or held: an epoch of millions of indices costs neither
    the time to draw them before the first batch nor the memory, which every forked
    worker would otherwise map and unmap (a stop waits for the workers' exits). Reads as
    a list of lists of ints, as ``IndexBatches`` does; a slice is another one."""

    __slots__ = ("_first", "_step", "_count", "_size", "_end")

    def __init__(self, first: int, step: int, count: int, size: int, end: int) -> None:
        self._first, self._step, self._count, self._size, self._end = first, step, count, size, end

    def __reduce__(self) -> tuple[Any, ...]:
        return (StridedBatches, (self._first, self._step, self._count, self._size, self._end))

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(self._count)
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            first = self._first + start * self._step
            return StridedBatches(first, self._step, max(0, stop - start), self._size, self._end)
        number = operator.index(key)
        if number < 0:
            number += self._count
        if not 0 <= number < self._count:
            raise IndexError("index batch out of range")
        begin = (self._first + number * self._step) * self._size
        return list(range(begin, min(begin + self._size, self._end)))

    def __iter__(self) -> Iterator[list[int]]:
        size, end, stride = self._size, self._end, self._step * self._size
        begin = self._first * size
        for _ in range(self._count):
            yield list(range(begin, min(begin + size, end)))
            begin += stride


def has_len(sampler: Any) -> bool:
    try:
        len(sampler)
    except TypeError:
        return False
    return True


def deal(batches: list[Any], workers: int) -> list[list[Any]]:
    """Index batch i to worker i % workers, as torch's round-robin does."""
    return [batches[w::workers] for w in range(workers)]
