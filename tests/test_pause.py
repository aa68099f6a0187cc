"""Pause, resume and limit through DataLoader2's iterator, as with torchdata's service:
an epoch interrupted any number of times yields the same items in the same order."""

from __future__ import annotations

import pytest
from torchdata.dataloader2 import DataLoader2, SequentialReadingService
from torchdata.dataloader2.reading_service import ReadingServiceInterface

import pipelines
from mprs_plus import MultiProcessingReadingService

PIPES = {
    "no_dispatch": lambda: pipelines.sharded_pipe(40),
    "dispatch": lambda: pipelines.NoGraphWrapper(40),
    "shuffled": lambda: pipelines.shuffled_pipe(40),
}


def read_in_chunks(loader, size):
    """The whole epoch, paused by ``limit(size)`` every ``size`` items and resumed."""
    iterator = iter(loader)
    iterator.limit(size)
    items, pauses = [], 0
    while True:
        chunk = list(iterator)
        assert len(chunk) <= size
        items += chunk
        if len(chunk) < size:
            return items, pauses
        pauses += 1
        with pytest.raises(StopIteration):  # paused: nothing until resume()
            next(iterator)
        iterator.resume()


@pytest.mark.parametrize("in_order", [True, False], ids=["in_order", "as_ready"])
@pytest.mark.parametrize("name", list(PIPES))
def test_interrupted_epochs_lose_and_repeat_nothing(name, in_order):
    loader = DataLoader2(PIPES[name](), reading_service=MultiProcessingReadingService(2, in_order=in_order))
    try:
        loader.seed(11)
        whole = list(loader)
        runs = {}
        for size in (1, 3, 16):
            loader.seed(11)
            runs[size] = read_in_chunks(loader, size)
    finally:
        loader.shutdown()
    assert sorted(map(pipelines.value_of, whole)) == list(range(40))
    for size, (items, pauses) in runs.items():
        assert pauses == 40 // size
        if in_order:
            assert items == whole, f"limit({size}) changed the order"
        else:
            assert sorted(map(pipelines.value_of, items)) == list(range(40))


@pytest.mark.parametrize("dispatch", [False, True], ids=["no_dispatch", "dispatch"])
def test_pause_and_resume_reach_the_datapipes_of_every_process(dispatch):
    pipelines.COUNTS.clear()
    loader = DataLoader2(pipelines.pause_aware_pipe(12, dispatch), reading_service=MultiProcessingReadingService(2))
    try:
        first, pauses = read_in_chunks(loader, 5)
        second = list(loader)  # made after the children applied PAUSE and RESUME, in order
    finally:
        loader.shutdown()
    assert pauses == 2
    assert [value for value, _ in first] == [value for value, _ in second] == list(range(12))
    # Main segment: called synchronously, like torchdata.
    assert pipelines.COUNTS == {"main.pause": 2, "main.resume": 2}
    for _, counts in second:
        assert counts["worker"] == {"worker.pause": 2, "worker.resume": 2}
        if dispatch:
            assert counts["dispatch"] == {"dispatch.pause": 2, "dispatch.resume": 2}


class HooksFromAnotherService(ReadingServiceInterface):
    """Stands for a reading service chained before ours that hands pause/resume/limit
    functions on, as SequentialReadingService allows."""

    def initialize(self, datapipe):
        return datapipe

    def _pause(self, pause_fn=None):
        return pipelines.pause_fn

    def _resume(self, resume_fn=None):
        return pipelines.resume_fn

    def _limit(self, num_batches, limit_fn=None):
        return pipelines.limit_fn


@pytest.mark.parametrize("dispatch", [False, True], ids=["no_dispatch", "dispatch"])
def test_pause_resume_limit_functions_run_in_the_children(dispatch):
    pipelines.COUNTS.clear()
    service = SequentialReadingService(HooksFromAnotherService(), MultiProcessingReadingService(2))
    loader = DataLoader2(pipelines.pause_aware_pipe(10, dispatch), reading_service=service)
    try:
        first, pauses = read_in_chunks(loader, 5)
        second = list(loader)
    finally:
        loader.shutdown()
    assert pauses == 2 and [v for v, _ in first] == [v for v, _ in second] == list(range(10))
    # As torchdata: with a dispatch process, it gets the limit and each worker its share;
    # without one, everybody (the main process too) gets None.
    limit = "limit_fn(5)" if dispatch else "limit_fn(None)"
    assert pipelines.COUNTS[limit] == 1
    for _, counts in second:
        worker = counts["worker"]
        assert worker["pause_fn"] == worker["resume_fn"] == 2
        assert sum(v for k, v in worker.items() if k.startswith("limit_fn")) == 1
        if dispatch:
            assert counts["dispatch"]["pause_fn"] == 2 and counts["dispatch"]["limit_fn(5)"] == 1
            assert set(worker) & {"limit_fn(2)", "limit_fn(3)"}
        else:
            assert worker["limit_fn(None)"] == 1


def test_pause_without_worker_processes():
    pipelines.COUNTS.clear()
    loader = DataLoader2(pipelines.pause_aware_pipe(9, False), reading_service=MultiProcessingReadingService(0))
    try:
        items, pauses = read_in_chunks(loader, 4)
    finally:
        loader.shutdown()
    assert [value for value, _ in items] == list(range(9)) and pauses == 2
    assert pipelines.COUNTS == {"main.pause": 2, "main.resume": 2, "worker.pause": 2, "worker.resume": 2}


def test_a_new_epoch_while_paused_starts_after_resume():
    loader = DataLoader2(pipelines.sharded_pipe(10), reading_service=MultiProcessingReadingService(2))
    try:
        iterator = iter(loader)
        iterator.limit(3)
        assert len(list(iterator)) == 3
        again = iter(loader)  # a new epoch, still paused
        assert list(again) == []
        again.resume()
        assert [value for value, _ in again] == list(range(10))
    finally:
        loader.shutdown()
