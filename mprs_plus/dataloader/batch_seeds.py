"""``seeding="batch"``: a batch's random draws belong to the batch, not to the worker making it.

    before each batch       random, numpy's global generator and torch's default CPU
    (worker, or main with   generator are seeded from SeedSequence(base_seed,
    num_workers=0)          spawn_key=(epoch, rank, position[, ...]))
    main process only       the trainer's generators are captured before and loaded after:
                            the loop sees them as if no batch had been made

Why: torch seeds worker k once with ``base_seed + k``, so a batch's augmentations depend on
which worker made it, how many workers there are, and every draw that worker made before
(a lost batch of a dead worker shifts all its later ones). Seeding each batch from its
place in the epoch makes the batch a function of (seed, epoch, rank, position, indices):
any worker count, a replacement worker, ``in_order=False``, or a restore at another count
make the same batches.

numpy's ``SeedSequence`` derives the seeds (its ``spawn_key`` exists for exactly this:
independent streams from one seed and a path of integers); one derivation and three seed
calls per batch, nothing per sample. torch's CUDA generators are not touched (a worker has
none, and the trainer's must stay its own). What is not seeded: a generator the dataset owns
(``self.rng = numpy.random.default_rng()``, a ``torch.Generator``), which keeps its own
stream, and draws a dataset makes outside a batch (an iterable dataset's ``__iter__``).
"""

from __future__ import annotations

import random
import sys
from typing import Any, NamedTuple

import torch

WORKER = "worker"
BATCH = "batch"
CHOICES = (WORKER, BATCH)


def check_seeding(seeding: Any) -> str:
    """The ``seeding`` argument, checked: ``"worker"`` (torch's) or ``"batch"``."""
    if seeding not in CHOICES:
        raise ValueError(f'seeding must be "worker" (torch\'s per-worker seeds) or "batch", got {seeding!r}')
    if seeding == BATCH:
        try:
            import numpy.random  # noqa: F401  (SeedSequence derives the batches' seeds)
        except ImportError:
            raise ValueError('seeding="batch" needs numpy (its SeedSequence derives each batch\'s seeds): '
                             "install numpy, or use seeding=\"worker\"") from None
    return seeding


class BatchSeeds(NamedTuple):
    """What a batch's seeds are derived from, besides its position: sent to each worker."""

    base_seed: int  # torch's base seed of the epoch
    epoch: int  # the loader's epoch number (persistent workers keep one base seed)
    rank: int  # the data-parallel rank: ranks seeded alike never share draws
    extra: tuple[int, ...] = ()  # a resumed remainder of an epoch (another world size): its mark

    def key(self, position: int, worker: int | None = None) -> tuple[int, ...]:
        """The spawn key of batch ``position``; an iterable dataset's batches are each
        worker's own (``worker``), the position counted in its stream."""
        own = () if worker is None else (worker,)
        return (self.epoch, self.rank, position, *own, *self.extra)

    def apply(self, position: int, worker: int | None = None) -> None:
        """Seed this process's global generators for batch ``position``."""
        import numpy as np

        # Words of their own for each generator: ``random`` and numpy's legacy generator are
        # both MT19937 seeded by init_by_array, so the same words would give one stream twice.
        words = np.random.SeedSequence(self.base_seed, spawn_key=self.key(position, worker)).generate_state(10)
        np.random.seed(words[:4])
        python = [int(word) for word in words[4:8]]
        random.seed(python[0] | python[1] << 32 | python[2] << 64 | python[3] << 96)
        torch.default_generator.manual_seed(int(words[8]) | int(words[9]) << 32)


class Kept:
    """The trainer's generators, around a batch made in its own process (``num_workers=0``):
    ``keep()`` before, ``give_back()`` after, whatever the batch raised."""

    __slots__ = ("_states",)

    def __init__(self) -> None:
        self._states: tuple[Any, Any, Any] | None = None

    def keep(self) -> None:
        numpy_random = sys.modules.get("numpy.random")
        self._states = (
            random.getstate(),
            torch.get_rng_state(),
            numpy_random.get_state() if numpy_random is not None else None,
        )

    def give_back(self) -> None:
        states, self._states = self._states, None
        if states is None:
            return
        python_state, torch_state, numpy_state = states
        random.setstate(python_state)
        torch.set_rng_state(torch_state)
        if numpy_state is not None:
            sys.modules["numpy.random"].set_state(numpy_state)


def batch_shard(batch_sampler: Any) -> Any:
    """Accelerate's ``BatchSamplerShard`` dealing whole batches (``split_batches=False``),
    where the loader's batch sampler is one, else None (read by its attributes: Accelerate
    is not imported for it)."""
    if type(batch_sampler).__name__ != "BatchSamplerShard":
        return None
    names = ("batch_sampler", "num_processes", "process_index", "split_batches", "even_batches", "drop_last")
    if not all(hasattr(batch_sampler, name) for name in names) or batch_sampler.split_batches:
        return None
    return batch_sampler


def rank_of(sampler: Any, batch_sampler: Any, distributed: tuple[int, int]) -> int:
    """The data-parallel rank a loader's batches belong to: its ``DistributedSampler``'s
    (also within a batch sampler), its ``BatchSamplerShard``'s process index (Accelerate),
    else ``torch.distributed``'s when initialised (the
    ``(world size, rank)`` taken as the epoch began), else 0."""
    found = distributed_sampler(sampler, batch_sampler)
    if found is not None:
        return int(found.rank)
    shard = batch_shard(batch_sampler)
    if shard is not None:
        return int(shard.process_index)
    return int(distributed[1])


def distributed_sampler(sampler: Any, batch_sampler: Any) -> Any:
    """The loader's ``torch.utils.data.DistributedSampler``, where it uses one, else None."""
    from torch.utils.data import DistributedSampler

    for candidate in (sampler, getattr(batch_sampler, "sampler", None), batch_sampler):
        if isinstance(candidate, DistributedSampler):
            return candidate
    return None
