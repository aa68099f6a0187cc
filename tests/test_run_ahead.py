"""How far the workers run ahead of a main process that stops reading: counted, not timed.

The map (and, with a dispatcher, the source) counts its calls in shared memory. The main
process takes one item and then waits until every lane of every child has slept in a
channel wait for a while (``runtime/liveness.py``): nothing can be produced after that
until the main process reads again. The counts must then be within the bound the
troubleshooting page states ("How far the workers run ahead"), with every item of a batch
counted.
"""

from __future__ import annotations

import math
import multiprocessing
import threading
import time

import numpy as np
import pytest
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from mprs_plus import MultiProcessingReadingService
from probes import record_liveness_tables

WORKERS = 2
BATCH = 64  # the most small items one message holds (runtime/child/batching.py)
LARGE = 128 << 10  # bytes: an item this large travels alone

_ctx = multiprocessing.get_context("fork")
_mapped = _ctx.Value("q", 0)
_dealt = _ctx.Value("q", 0)


def _count(counter, item):
    with counter.get_lock():
        counter.value += 1
    return item


def mapped(item):
    return _count(_mapped, item)


def dealt(item):
    return _count(_dealt, item)


def large(item):
    return np.full(LARGE // 8, item, dtype=np.float64)


def _produced_while_waiting(monkeypatch, pipe, **options) -> tuple[int, int]:
    """Take one item, then wait (bounded) until every child has slept in a channel wait
    for a second: production has stopped. The counts (mapped, dealt) are read then, before
    the shutdown, whose stop may let a worker blocked on a full channel make one more item."""
    made = record_liveness_tables(monkeypatch)
    _mapped.value = _dealt.value = 0
    service = MultiProcessingReadingService(WORKERS, multiprocessing_context="fork", **options)
    loader = DataLoader2(pipe, reading_service=service)
    try:
        next(iter(loader))
        [table] = made
        runtime = loader.reading_service._runtime
        lanes = [row for link in runtime._topology.children() for row in link.stats_rows]
        deadline = time.monotonic() + 30
        waiting = threading.Event()
        while not table.asleep_for(lanes, 1.0):
            assert time.monotonic() < deadline, "the producers never all waited for room"
            waiting.wait(0.05)
        return _mapped.value, _dealt.value
    finally:
        loader.shutdown()


def _messages(worker_prefetch_cnt: int, main_prefetch_cnt: int) -> int:
    """B: the room, in messages, of each worker's channel to the main process."""
    return max(1, worker_prefetch_cnt + math.ceil(main_prefetch_cnt / WORKERS))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("prefetch", [(10, 10), (0, 0)], ids=["defaults", "no_prefetch"])
def test_small_items_stay_within_the_stated_bound_counting_every_item_of_a_batch(monkeypatch, prefetch):
    worker_prefetch_cnt, main_prefetch_cnt = prefetch
    pipe = IterableWrapper(range(10**6)).sharding_filter().map(mapped)
    mapped_count, _ = _produced_while_waiting(
        monkeypatch, pipe, worker_prefetch_cnt=worker_prefetch_cnt, main_prefetch_cnt=main_prefetch_cnt
    )
    bound = WORKERS * (_messages(*prefetch) + 2) * BATCH
    assert 1 <= mapped_count <= 1 + bound


@pytest.mark.timeout(90)
def test_large_items_stay_within_the_stated_bound(monkeypatch):
    pipe = IterableWrapper(range(10**6)).sharding_filter().map(mapped).map(large)
    mapped_count, _ = _produced_while_waiting(monkeypatch, pipe, worker_prefetch_cnt=2, main_prefetch_cnt=2)
    # Per worker: its channel, the item it is sending, one the main process may hold.
    assert 1 <= mapped_count <= 1 + WORKERS * (_messages(2, 2) + 2)


@pytest.mark.timeout(90)
def test_a_dispatcher_runs_ahead_of_each_worker_within_the_stated_bound(monkeypatch):
    buffer = 3
    pipe = (
        IterableWrapper(range(10**6))
        .map(dealt)
        .sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
        .map(mapped)
    )
    mapped_count, dealt_count = _produced_while_waiting(
        monkeypatch, pipe, worker_prefetch_cnt=2, main_prefetch_cnt=2, dispatch_buffer_size=buffer
    )
    assert 1 <= mapped_count <= 1 + WORKERS * (_messages(2, 2) + 2) * BATCH
    # Beyond what the workers took, per worker: its channel, the batch being dealt to it,
    # and the message it is taking items from.
    assert mapped_count <= dealt_count <= mapped_count + WORKERS * (buffer + 2) * min(BATCH, buffer) + 1
