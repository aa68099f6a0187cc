"""What the workloads share: per-item work, a torch ``IterableDataset`` doing the same
work as the DataPipes, and runners for the common ``range -> sharding_filter -> map`` shape.

The same ``IterableDataset`` is what SPDL's contender iterates in its one subprocess: with
no torch worker info there, it yields every item, ``fn(i)`` for ``i`` in ``range(n)``.

Everything that reaches a worker is a module-level function or class, so that it pickles
by reference under every start method.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.utils.data
from torchdata.datapipes.iter import IterableWrapper

from .. import harness


def identity(item: Any) -> Any:
    return item


def numpy_array(index: int, nbytes: int) -> np.ndarray:
    """A fresh array of ``nbytes`` bytes, filled so that every page is really written."""
    return np.full(nbytes, index % 251, dtype=np.uint8)


def torch_tensor(index: int, numel: int) -> torch.Tensor:
    """A fresh float32 tensor of ``numel`` elements, every element written."""
    return torch.full((numel,), float(index), dtype=torch.float32)


def burn(item: Any, loops: int) -> Any:
    """Pure-Python CPU work: holds the GIL for the whole loop, as Python preprocessing does."""
    acc = 0
    for i in range(loops):
        acc = (acc + i * i) & 0xFFFF
    return item


def calibrate_loops(seconds: float = 0.002, trials: int = 11) -> int:
    """The ``burn`` loop count that takes about ``seconds`` on this machine.

    The fastest of several trials is used: it is the cost of the work itself, without
    whatever else the machine was doing meanwhile.
    """
    probe = 50_000
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        burn(None, probe)
        best = min(best, time.perf_counter() - start)
    return max(1, round(probe * seconds / best))


class Ints(torch.utils.data.Dataset):
    """Sample ``i`` is the int ``i``: nothing to compute or copy, only the loader's overhead."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class ShardedRange(torch.utils.data.IterableDataset):
    """``fn(i)`` for ``i`` in ``range(n)``, split across torch DataLoader workers by
    ``i % num_workers``: the same items and work per item as the DataPipe equivalents."""

    def __init__(self, n: int, fn: Callable[[int], Any]) -> None:
        self.n = n
        self.fn = fn

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        return map(self.fn, range(first, self.n, step))


# SPDL's pool: a segment per item in flight. Its queue holds 3 items (buffer_size, left
# at SPDL's default), the producer writes a fourth and the consumer holds a fifth; 8
# segments cover that with room, so the producer never waits on a reclaim still on
# its way, and every segment is touched during the warm-up of a full run.
SPDL_SEGMENTS = 8


def spdl_pool(item_bytes: int) -> harness.SegmentPool:
    """SPDL's arena for items of ``item_bytes``: SPDL_SEGMENTS segments of one item each."""
    return harness.SegmentPool(segment_bytes=item_bytes, count=SPDL_SEGMENTS)


def mapped_range(n: int, fn: Callable[[int], Any]) -> Any:
    """``range(n) -> sharding_filter -> map(fn)``: each worker makes its share of the items."""
    return IterableWrapper(range(n)).sharding_filter().map(fn)


def mapped_range_runners(
    items: Callable[[harness.Settings], int],
    make_fn: Callable[[harness.Settings], Callable[[int], Any]],
    item_bytes: int = 0,
    spdl_pool: harness.SegmentPool | None = None,
) -> dict[str, harness.Runner]:
    """A throughput runner per contender for ``fn(i) for i in range(n)``.

    ``spdl_pool`` sizes SPDL's shared-memory arena; without one, SPDL moves items through
    its queue alone (pickled), as it does for items with nothing large to offload.
    """

    def run(contender: str, settings: harness.Settings) -> dict[str, float]:
        n, fn = items(settings), make_fn(settings)
        return harness.stream(
            lambda: harness.open_loader(
                contender, settings, pipe=mapped_range(n, fn), dataset=ShardedRange(n, fn), pool=spdl_pool
            ),
            items=n,
            settings=settings,
            item_bytes=item_bytes,
        )

    return {contender: functools.partial(run, contender) for contender in harness.CONTENDERS}
