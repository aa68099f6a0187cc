"""A starved in-order read is an error whatever the options, and a slow one never is.

The cycle ``service.py`` describes, closed on purpose (``pipelines.starving_pipe``: worker
1 keeps none of its items, the dispatcher waits for room at worker 0, which waits for the
main process) raises ``PipelineStuckError`` with statistics on and off, under fork and
spawn. Its evidence (every child lane asleep in a channel wait, ``runtime/liveness.py``)
is kept whatever the options. The look-alikes never raise: a worker or a source that is
slow for ten detection spans, and a main process that stops reading for as many.

The detection span is made small (``STUCK_SECONDS``) so that each case stays short; the
slow cases last ten spans, five times the two slices after which a starved read
raises, so they would have raised if they were going to.
"""

from __future__ import annotations

import threading
import time

import pytest
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

import pipelines
from probes import record_liveness_tables
from mprs_plus import MultiProcessingReadingService, PipelineStuckError
from mprs_plus.runtime.main import reader as main_reader

SPAN = 0.2  # seconds: the detection span in these tests (STUCK_SECONDS)
SLOW_SPANS = 10  # how long the look-alikes last


def _loader(pipe, **options) -> DataLoader2:
    options.setdefault("multiprocessing_context", "fork")
    return DataLoader2(pipe, reading_service=MultiProcessingReadingService(2, **options))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "collect_stats, context",
    # With statistics on under forkserver: test_order.py.
    [(False, "fork"), (False, "forkserver"), (True, "fork")],
)
def test_a_starved_in_order_read_raises_with_statistics_on_and_off(monkeypatch, collect_stats, context):
    monkeypatch.setattr(main_reader, "STUCK_SECONDS", SPAN)
    loader = _loader(pipelines.starving_pipe(20000), multiprocessing_context=context, collect_stats=collect_stats)
    try:
        with pytest.raises(PipelineStuckError, match="worker 1's next item can never come.*Pass in_order=False"):
            list(loader)
    finally:
        loader.shutdown()


@pytest.mark.timeout(60)
def test_with_the_default_span_and_no_statistics_it_raises_within_15_seconds():
    loader = _loader(pipelines.starving_pipe(20000), collect_stats=False)
    started = time.monotonic()
    try:
        with pytest.raises(PipelineStuckError):
            list(loader)
        assert time.monotonic() - started < 15
    finally:
        loader.shutdown()


def slow_io_on(item: int, slow: int, seconds: float) -> int:
    """Waits ``seconds`` on item ``slow``, as a read from a slow disk or network would: the
    lane is busy (not in a channel wait) all that time."""
    if item == slow:
        time.sleep(seconds)
    return item


def _slow_worker_pipe(n: int):
    # Worker 1's first item takes SLOW_SPANS spans, while worker 0 fills its channel and the
    # dispatcher waits for room at worker 0: from outside, the stuck picture.
    dispatched = IterableWrapper(range(n)).sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    return dispatched.map(_SlowOn(1, SLOW_SPANS * SPAN))


def _slow_source_pipe(n: int):
    # The source (in the dispatch process) stalls for SLOW_SPANS spans on item 40, while the
    # workers wait for input and the main process for worker 0.
    source = IterableWrapper(range(n)).map(_SlowOn(40, SLOW_SPANS * SPAN))
    return source.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING).map(pipelines.identity)


class _SlowOn:
    def __init__(self, slow: int, seconds: float) -> None:
        self.slow, self.seconds = slow, seconds

    def __call__(self, item: int) -> int:
        return slow_io_on(item, self.slow, self.seconds)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("collect_stats", [True, False])
@pytest.mark.parametrize("pipe", [_slow_worker_pipe, _slow_source_pipe], ids=["slow_worker", "slow_source"])
def test_a_slow_worker_or_source_is_never_called_stuck(monkeypatch, collect_stats, pipe):
    monkeypatch.setattr(main_reader, "STUCK_SECONDS", SPAN)
    loader = _loader(pipe(200), collect_stats=collect_stats, dispatch_buffer_size=2)
    try:
        assert list(loader) == list(range(200))
    finally:
        loader.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("collect_stats", [True, False])
def test_a_long_pause_of_the_main_process_is_never_called_stuck(monkeypatch, collect_stats):
    """The main process stops reading until every child has slept in a channel wait for
    ten spans (a 40 s pause at the default span), then reads on: nothing is stuck."""
    monkeypatch.setattr(main_reader, "STUCK_SECONDS", SPAN)
    made = record_liveness_tables(monkeypatch)
    # Far more items than the channels hold: every producer ends up waiting for room.
    loader = _loader(pipelines.plain_pipe(range(20000), dispatch=True), collect_stats=collect_stats)
    try:
        items = iter(loader)
        head = [next(items) for _ in range(5)]
        [table] = made
        service = loader.reading_service._runtime
        lanes = [row for link in service._topology.children() for row in link.stats_rows]
        deadline = time.monotonic() + 30
        pause = threading.Event()
        while not table.asleep_for(lanes, SLOW_SPANS * SPAN):  # the pause: until every child sleeps that long
            assert time.monotonic() < deadline, "the children never all slept: producers still running?"
            pause.wait(SPAN / 4)
        assert head + list(items) == [2 * i for i in range(20000)]
    finally:
        loader.shutdown()
