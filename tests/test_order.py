"""Order modes: deterministic round-robin by default; as ready with ``in_order=False``."""

from __future__ import annotations

import functools
import logging
import multiprocessing

import pytest
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

import pipelines
from mprs_plus import MultiProcessingReadingService, PipelineStuckError
from mprs_plus.runtime import liveness
from mprs_plus.runtime.main import reader as main_reader


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dispatch", [False, True], ids=["no_dispatch", "dispatch"])
def test_as_ready_yields_other_workers_items_while_one_is_stuck(monkeypatch, dispatch):
    """Worker 0 cannot finish item 0 until the main process has read five items, which
    only the other worker can provide: round-robin would wait for item 0 forever."""
    release = multiprocessing.get_context("fork").Event()
    monkeypatch.setattr(pipelines, "HELD", {0: release})
    pipe = pipelines.plain_pipe(range(20), dispatch).map(pipelines.held_until_set)
    # plain_pipe doubles the items: item 0 is still 0, the other worker's are 2, 6, 10, ...
    service = MultiProcessingReadingService(2, multiprocessing_context="fork", in_order=False, dispatch_buffer_size=4)
    loader = DataLoader2(pipe, reading_service=service)
    try:
        iterator = iter(loader)
        first = [next(iterator) for _ in range(5)]
        release.set()
        rest = list(iterator)
    finally:
        loader.shutdown()
    assert 0 not in first and all(item % 4 == 2 for item in first)
    assert sorted(first + rest) == [2 * i for i in range(20)]


@pytest.mark.parametrize("dispatch", [False, True], ids=["no_dispatch", "dispatch"])
def test_in_order_is_round_robin_and_as_ready_is_exactly_once(dispatch):
    results = {}
    for in_order in (True, False):
        loader = DataLoader2(
            pipelines.plain_pipe(range(25), dispatch),
            reading_service=MultiProcessingReadingService(3, in_order=in_order),
        )
        try:
            results[in_order] = [list(loader) for _ in range(2)]
        finally:
            loader.shutdown()
    assert results[True] == [[2 * i for i in range(25)]] * 2
    for epoch in results[False]:
        assert sorted(epoch) == [2 * i for i in range(25)]


def test_as_ready_in_process_is_plain_iteration():
    loader = DataLoader2(IterableWrapper(range(5)), reading_service=MultiProcessingReadingService(0, in_order=False))
    try:
        assert list(loader) == list(range(5))
    finally:
        loader.shutdown()


@pytest.mark.timeout(60)
def test_a_starved_read_the_service_cannot_prove_stuck_is_reported_and_its_timeout_says_why(monkeypatch, caplog):
    """The cycle ``service.py`` describes, closed on purpose: worker 1 keeps no item, so the
    main process waits for it while worker 0 fills its channel, and the dispatcher waits
    for room at worker 0. Forced here: every look at the processes finds one awake (as if
    it computed), so the service only warns, and the timeout names the cause."""
    monkeypatch.setattr(main_reader, "STUCK_SECONDS", 0.3)
    monkeypatch.setattr(liveness.Liveness, "asleep_for", lambda self, slots, seconds: False)
    service = MultiProcessingReadingService(2, multiprocessing_context="fork", timeout=4, collect_stats=False)
    loader = DataLoader2(pipelines.starving_pipe(20000), reading_service=service)
    try:
        with caplog.at_level(logging.WARNING, logger="mprs_plus"):
            with pytest.raises(TimeoutError, match="no item from worker 1 .*Pass in_order=False"):
                list(loader)
    finally:
        loader.shutdown()
    [report] = [record for record in caplog.records if "waited" in record.getMessage()]
    assert "for worker 1's next item" in report.getMessage() and "in_order=False" in report.getMessage()


def test_as_ready_reads_through_the_imbalance_in_order_cannot():
    service = MultiProcessingReadingService(2, multiprocessing_context="fork", in_order=False)
    loader = DataLoader2(pipelines.starving_pipe(20000), reading_service=service)
    try:
        assert sorted(loader) == list(range(0, 20000, 2))
    finally:
        loader.shutdown()


@pytest.mark.timeout(60)
def test_without_a_dispatcher_a_long_wait_is_not_reported(monkeypatch, caplog):
    """Each worker reads its own shard: a long wait for one is a slow worker, never the cycle."""
    monkeypatch.setattr(main_reader, "STUCK_SECONDS", 0.2)
    pipe = pipelines.plain_pipe(range(40), dispatch=False).map(functools.partial(pipelines.spin, seconds=0.05))
    loader = DataLoader2(pipe, reading_service=MultiProcessingReadingService(2, multiprocessing_context="fork"))
    try:
        with caplog.at_level(logging.WARNING, logger="mprs_plus"):
            assert list(loader) == [2 * i for i in range(40)]
    finally:
        loader.shutdown()
    assert "waited" not in caplog.text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_an_in_order_read_a_dispatcher_starves_raises_instead_of_hanging(monkeypatch, start_method):
    """No timeout set: every process sleeping in a channel wait while the main process
    waits proves that the cycle closed, and the read raises the documented error."""
    monkeypatch.setattr(main_reader, "STUCK_SECONDS", 0.3)
    service = MultiProcessingReadingService(2, multiprocessing_context=start_method)
    loader = DataLoader2(pipelines.starving_pipe(20000), reading_service=service)
    try:
        with pytest.raises(PipelineStuckError, match="worker 1's next item can never come.*Pass in_order=False"):
            list(loader)
    finally:
        loader.shutdown()


class _ReleaseOnWarning(logging.Handler):
    """Sets ``event`` once the main process has logged the long-wait warning."""

    def __init__(self, event) -> None:
        super().__init__(logging.WARNING)
        self.event = event

    def emit(self, record: logging.LogRecord) -> None:
        if "waited" in record.getMessage():
            self.event.set()


@pytest.mark.timeout(90)
def test_a_worker_fed_by_a_dispatcher_that_is_only_slow_is_never_called_stuck(monkeypatch, caplog):
    """Worker 1 computes on its first item while worker 0, its input cut off by the
    dispatcher waiting on worker 1, sits on unread output: the same picture as the cycle
    from outside (so a warning), but a computing worker is not asleep, so no error, and
    every item comes. Forced: worker 0 finishes its later items only once the main process
    holds item 0 (so they wait unread in its channel, not beside item 0 in the message the
    main process took), and worker 1 its first only once the warning came."""
    monkeypatch.setattr(main_reader, "STUCK_SECONDS", 0.1)
    fork = multiprocessing.get_context("fork")
    later_on_worker_0, first_on_worker_1 = fork.Event(), fork.Event()
    monkeypatch.setattr(pipelines, "HELD", {4: later_on_worker_0, 2: first_on_worker_1})
    # plain_pipe doubles the items: worker 0 takes 0, 4, 8, ..., worker 1 takes 2, 6, 10, ...
    pipe = pipelines.plain_pipe(range(200), dispatch=True).map(pipelines.held_until_set)
    service = MultiProcessingReadingService(2, multiprocessing_context="fork", dispatch_buffer_size=2)
    loader = DataLoader2(pipe, reading_service=service)
    handler = _ReleaseOnWarning(first_on_worker_1)
    logging.getLogger("mprs_plus").addHandler(handler)
    try:
        with caplog.at_level(logging.WARNING, logger="mprs_plus"):
            items = iter(loader)
            assert next(items) == 0
            later_on_worker_0.set()
            assert list(items) == [2 * i for i in range(1, 200)]
    finally:
        logging.getLogger("mprs_plus").removeHandler(handler)
        later_on_worker_0.set()
        first_on_worker_1.set()
        loader.shutdown()
    assert "for worker 1's next item" in caplog.text


@pytest.mark.timeout(60)
def test_a_stuck_read_first_seen_while_a_process_still_ran_raises_at_a_later_look(monkeypatch, caplog):
    """The first look at the stalled picture finds a process not yet asleep for a whole
    span (forced here: that look answers no): a warning, and the next look must still
    raise, never leave the read waiting forever with only a warning."""
    monkeypatch.setattr(main_reader, "STUCK_SECONDS", 0.3)
    looks = []
    real = liveness.Liveness.asleep_for

    def first_look_says_no(self, slots, seconds):
        looks.append(seconds)
        return len(looks) > 1 and real(self, slots, seconds)

    monkeypatch.setattr(liveness.Liveness, "asleep_for", first_look_says_no)
    service = MultiProcessingReadingService(2, multiprocessing_context="fork")
    loader = DataLoader2(pipelines.starving_pipe(20000), reading_service=service)
    try:
        with caplog.at_level(logging.WARNING, logger="mprs_plus"):
            with pytest.raises(PipelineStuckError):
                list(loader)
    finally:
        loader.shutdown()
    assert len(looks) >= 2 and "for worker 1's next item" in caplog.text
