"""Positions in an epoch, not in a worker: what makes a checkpoint independent of the worker
count and of the world size. Pure: no processes, no I/O.

    Layout(start, done)   the epoch's batches still to make: every position from ``start``
                          on, but those in ``done`` (made out of order before a state was
                          taken). A fresh epoch is Layout(0, ()).
    deal                  the remaining positions, round-robin over the workers: worker w
                          makes the remaining batches w, w + M, ... (torch's i % M when
                          nothing is done yet)
    fold                  a state's per-worker counts over that deal -> the Layout of what
                          is left: the same for any count, so M workers (0 included) take over
    Remainder             a sharded epoch as one global order (a ``DistributedSampler``'s
                          own for num_replicas=1; the batches Accelerate's
                          ``BatchSamplerShard`` deals) of which the first ``done`` were made
                          by some world size: the rest split over this world's ranks

Why positions are enough: with ``seeding="batch"`` a batch is a function of its indices
and its position (``batch_seeds.py``), so nothing a worker drew before matters, and a
restore needs no replay: it deals what is left.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple


SAMPLES = "samples"
BATCHES = "batches"


class Layout(NamedTuple):
    """Which batches of the epoch are still to make: positions ``start`` and on, except ``done``."""

    start: int = 0
    done: tuple[int, ...] = ()  # sorted, each above start

    @classmethod
    def from_dict(cls, state: Any) -> Layout:
        if not state:
            return cls()
        return cls(int(state["start"]), tuple(int(p) for p in state["done"]))

    def to_dict(self) -> dict[str, Any]:
        return {"start": self.start, "done": list(self.done)}

    @property
    def fresh(self) -> bool:
        return self.start == 0 and not self.done

    def remaining(self) -> Iterator[int]:
        """The positions still to make, in order, without end (the caller stops at the epoch's)."""
        done = self.done
        for position in itertools.count(self.start):
            index = bisect.bisect_left(done, position)
            if index < len(done) and done[index] == position:
                continue
            yield position

    def keeps(self, position: int) -> bool:
        if position < self.start:
            return False
        index = bisect.bisect_left(self.done, position)
        return not (index < len(self.done) and self.done[index] == position)

    def fold(self, workers: int, consumed: Sequence[int]) -> Layout:
        """What is left once worker w of ``workers`` (0: one, the loop's own process) made its
        first ``consumed[w]`` batches of this layout's deal."""
        workers = max(workers, 1)
        made = {i * workers + w for w, count in enumerate(consumed) for i in range(count)}
        if not made:
            return self
        first_left = min(count * workers + w for w, count in enumerate(consumed))
        positions = list(itertools.islice(self.remaining(), max(max(made), first_left) + 1))
        start = positions[first_left]
        done = {p for p in self.done if p > start} | {positions[j] for j in made if j > first_left}
        return Layout(start, tuple(sorted(done)))

    def deal(self, total: int, workers: int) -> list[list[int]]:
        """Each worker's positions of what is left of an epoch of ``total`` batches."""
        left = list(itertools.takewhile(lambda p: p < total, self.remaining()))
        return [left[w::workers] for w in range(max(workers, 1))]


class Remainder(NamedTuple):
    """An epoch of a sharded loader, as any world size can take it over: one global order
    (``unit``: the samples of a ``DistributedSampler``, or the batches of the batch sampler
    that Accelerate's ``BatchSamplerShard`` deals), of which the first ``done`` were made;
    the rest split over ``world`` ranks as the sharding splits an epoch."""

    size: int  # len(dataset) (samples)
    shuffle: bool  # the sampler's (samples)
    seed: int  # the sampler's (samples)
    epoch: int  # the sampler's epoch, set_epoch() (samples)
    drop_last: bool  # cut the rest to a multiple of the world size
    world: int  # the world size this epoch's rest is split over
    done: int = 0  # units of the global order made before (by another world size)
    unit: str = SAMPLES
    pad: bool = True  # not drop_last: pad the rest to a multiple of the world size (else uneven ranks)

    @classmethod
    def of(cls, sampler: Any) -> Remainder:
        return cls(len(sampler.dataset), bool(sampler.shuffle), int(sampler.seed), int(sampler.epoch),
                   bool(sampler.drop_last), int(sampler.num_replicas))

    @classmethod
    def of_shard(cls, shard: Any) -> Remainder:
        return cls(0, False, 0, 0, bool(shard.drop_last), int(shard.num_processes), unit=BATCHES,
                   pad=bool(shard.even_batches))

    @classmethod
    def from_dict(cls, state: Any) -> Remainder | None:
        return None if not state else cls(**state)

    def to_dict(self) -> dict[str, Any]:
        return self._asdict()

    def order(self) -> list[int]:
        """A ``DistributedSampler`` epoch's global order: the sampler's own for a single
        replica (its permutation, by torch's code), unpadded."""
        from torch.utils.data import DistributedSampler

        sampler = DistributedSampler(range(self.size), num_replicas=1, rank=0, shuffle=self.shuffle, seed=self.seed)
        sampler.set_epoch(self.epoch)
        return list(sampler)

    def split(self, order: list[Any], rank: int) -> list[Any]:
        """Rank ``rank``'s part of what is left of ``order``, split as the sharding splits
        an epoch: cut to a multiple of the world size (``drop_last``), or padded to one by
        repeating its start (``pad``), then every world-th from ``rank`` on. With nothing
        done yet, exactly the sharding's own part (a ``BatchSamplerShard``'s aside from the
        samples it adds to complete a short last batch)."""
        rest = list(order[self.done :])
        world = self.world
        if self.drop_last:
            rest = rest[: len(rest) // world * world]
        elif self.pad and rest and len(rest) % world:
            padding = world - len(rest) % world
            rest += (rest * math.ceil(padding / len(rest)))[:padding]
        return rest[rank::world]

    def indices(self, rank: int) -> list[int]:
        """A ``DistributedSampler``'s: rank ``rank``'s samples of what is left."""
        return self.split(self.order(), rank)

    def taken_over(self, batches_made: int, batch_size: int, world: int) -> Remainder:
        """What is left once every rank made its first ``batches_made`` batches of this
        split (data-parallel ranks step together), to be split over ``world`` ranks."""
        made = batches_made * self.world * (batch_size if self.unit == SAMPLES else 1)
        done = self.done + made
        if self.unit == SAMPLES:
            done = min(self.size, done)
        return self._replace(world=world, done=done)


def batches_of(indices: list[int], batch_size: int, drop_last: bool) -> list[list[int]]:
    """``indices`` cut as torch's ``BatchSampler`` cuts them."""
    end = len(indices) - len(indices) % batch_size if drop_last else len(indices)
    return [indices[i : i + batch_size] for i in range(0, end, batch_size)]
