"""Live statistics: values that must hold, and the verdicts for clear-cut cases."""

from __future__ import annotations

import functools
import logging

import pytest
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

import pipelines
from mprs_plus import MultiProcessingReadingService
from mprs_plus.stats import SegmentStats, bottleneck


def run_epoch(pipe, consume=None, **options):
    service = MultiProcessingReadingService(2, **options)
    loader = DataLoader2(pipe, reading_service=service)
    try:
        for item in loader:
            if consume is not None:
                consume(item)
        return loader.reading_service.stats()
    finally:
        loader.shutdown()


def test_items_out_of_workers_equal_items_into_main():
    stats = run_epoch(IterableWrapper(range(1000)).sharding_filter().map(pipelines.kilobytes))
    workers, main = stats.segment("worker"), stats.segment("main")
    assert workers.processes == 2 and main.processes == 1
    assert workers.items_out == main.items_in == 1000
    assert workers.bytes_out >= 1000 * 64 * 1024  # every payload crossed a channel
    assert [p.items_out for p in stats.processes if p.role == "worker"] == [500, 500]
    for process in stats.processes:
        assert 0.0 <= process.busy_fraction <= 1.0 and process.elapsed_s > 0


def test_dispatch_items_reach_workers_and_main():
    pipe = IterableWrapper(range(300)).sharding_round_robin_dispatch(
        pipelines.SHARDING_PRIORITIES.MULTIPROCESSING
    ).map(pipelines.double)
    stats = run_epoch(pipe)
    dispatch, workers, main = (stats.segment(name) for name in ("dispatch", "worker", "main"))
    assert dispatch.items_out == workers.items_in == workers.items_out == main.items_in == 300


def test_slow_workers_are_named_the_bottleneck():
    stats = run_epoch(IterableWrapper(range(200)).sharding_filter().map(pipelines.spin))
    assert stats.bottleneck.startswith("the workers are the bottleneck"), stats.summary()
    assert stats.segment("main").input_wait_fraction > 0.5


def test_slow_main_process_is_named_the_bottleneck():
    consume = functools.partial(pipelines.spin, seconds=0.005)
    stats = run_epoch(IterableWrapper(range(200)).sharding_filter(), consume=consume)
    assert stats.bottleneck.startswith("the main process is the bottleneck"), stats.summary()


@pytest.mark.parametrize(
    "segments, verdict",
    [
        (
            [
                SegmentStats("dispatch", 1, 0, 100, 0.95, 0.0, 0.0, 0),
                SegmentStats("worker", 2, 100, 100, 0.2, 0.8, 0.0, 0),
                SegmentStats("main", 1, 100, 100, 0.1, 0.9, 0.0, 0),
            ],
            "the dispatch process is the bottleneck",
        ),
        (
            [SegmentStats("worker", 2, 0, 100, 0.1, 0.0, 0.85, 0), SegmentStats("main", 1, 100, 100, 0.9, 0.1, 0, 0)],
            "the main process is the bottleneck",
        ),
        (
            [SegmentStats("worker", 2, 0, 100, 0.97, 0.0, 0.0, 0), SegmentStats("main", 1, 100, 100, 0.2, 0.8, 0, 0)],
            "the workers are the bottleneck: they are 97% busy",
        ),
        (
            [SegmentStats("worker", 2, 0, 100, 0.5, 0.0, 0.2, 0), SegmentStats("main", 1, 100, 100, 0.5, 0.4, 0, 0)],
            "balanced",
        ),
    ],
    ids=["dispatch", "main", "workers", "balanced"],
)
def test_verdicts(segments, verdict):
    assert bottleneck(segments).startswith(verdict)


def test_no_statistics_before_an_epoch_or_when_disabled():
    service = MultiProcessingReadingService(2)
    assert service.stats().bottleneck.startswith("no statistics yet")
    stats = run_epoch(IterableWrapper(range(10)).sharding_filter(), collect_stats=False)
    assert stats.processes == () and stats.bottleneck.startswith("no statistics yet")


def test_periodic_summary_is_logged(caplog):
    caplog.set_level(logging.INFO, logger="mprs_plus.stats")
    run_epoch(IterableWrapper(range(300)).sharding_filter().map(pipelines.spin), stats_interval=0.1)
    summaries = [r for r in caplog.records if r.name == "mprs_plus.stats"]
    assert summaries and "worker" in summaries[-1].getMessage()


def test_stats_interval_needs_collection():
    with pytest.raises(ValueError, match="needs collect_stats=True"):
        MultiProcessingReadingService(2, collect_stats=False, stats_interval=1.0)


def test_the_service_object_the_user_created_reports_the_running_copy():
    service = MultiProcessingReadingService(2)
    assert service.stats().processes == ()
    loader = DataLoader2(IterableWrapper(range(40)).sharding_filter(), reading_service=service)
    try:
        for _ in range(2):
            assert len(list(loader)) == 40
        assert loader.reading_service is not service  # DataLoader2 runs a copy
        live = service.stats()
        assert live.segment("main").items_in == 80
        assert live.segment("worker").items_out == loader.reading_service.stats().segment("worker").items_out
    finally:
        loader.shutdown()
    final = service.stats()  # as they stood at shutdown
    assert final.segment("main").items_in == 80
    assert loader.reading_service.stats().segment("main").items_in == 80


def test_copies_in_two_loaders_report_the_last_one_started():
    service = MultiProcessingReadingService(2)
    first = DataLoader2(IterableWrapper(range(10)).sharding_filter(), reading_service=service)
    second = DataLoader2(IterableWrapper(range(30)).sharding_filter(), reading_service=service)
    try:
        list(first)
        list(second)
        assert service.stats().segment("main").items_in == 30
        assert first.reading_service.stats().segment("main").items_in == 10
    finally:
        first.shutdown()
        second.shutdown()
