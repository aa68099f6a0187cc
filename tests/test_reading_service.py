"""The reading service through DataLoader2: placement by process id, exactly-once
delivery, epochs, seeds, hooks, errors, start methods, shutdown."""

from __future__ import annotations

import os
import warnings
from collections import Counter

import psutil
import pytest
from torchdata.dataloader2 import DataLoader2, SequentialReadingService
from torchdata.datapipes.iter import IterableWrapper

import pipelines
from torchdata_reference import descendants, shut_down
from mprs_plus import AmbiguousGraphError, MultiProcessingReadingService, ServiceClosedError


def run(datapipe, epochs=1, seed=None, **options):
    options.setdefault("num_workers", 2)
    loader = DataLoader2(datapipe, reading_service=MultiProcessingReadingService(**options))
    try:
        if seed is not None:
            loader.seed(seed)
        return [list(loader) for _ in range(epochs)]
    finally:
        loader.shutdown()


def assert_split(rows, n, dispatch=True):
    values = [value for value, _ in rows]
    assert sorted(values) == list(range(n)), "each item exactly once"
    main = os.getpid()
    workers = {pids["worker"] for _, pids in rows}
    assert len(workers) == 2 and main not in workers
    assert {pids["post"] for _, pids in rows} == {main}
    if dispatch:
        (pre,) = {pids["pre"] for _, pids in rows}
        assert pre != main and pre not in workers


@pytest.mark.parametrize(
    "factory",
    [
        lambda: pipelines.seed_pipe(IterableWrapper(range(8))),
        pipelines.NoGraphWrapper,
        pipelines.ParentsWrapper,
        pipelines.ListWrapper,
        lambda: pipelines.Outer(pipelines.NoGraphWrapper()),
        pipelines.MidGraphRef,
    ],
    ids=["seed", "nograph", "get_parents", "list_and_dict", "wrapper_of_wrapper", "mid_graph_ref"],
)
def test_each_stage_runs_in_its_process(factory):
    (rows,) = run(factory())
    assert_split(rows, 8)


def test_sharding_filter_without_dispatcher():
    (rows,) = run(pipelines.sharded_pipe(10))
    assert_split(rows, 10, dispatch=False)


def test_every_start_method(start_method):
    (rows,) = run(pipelines.NoGraphWrapper(6), multiprocessing_context=start_method)
    assert_split(rows, 6)


def test_round_robin_order_is_deterministic():
    (rows,) = run(pipelines.sharded_pipe(9))
    assert [value for value, _ in rows] == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    workers = [pids["worker"] for _, pids in rows]
    assert workers[0::2] == [workers[0]] * 5 and workers[1::2] == [workers[1]] * 4


def test_the_seed_wrapper_is_refused_not_sequentialized():
    loader = DataLoader2(pipelines.Wrapper(), reading_service=MultiProcessingReadingService(2))
    with pytest.raises(AmbiguousGraphError, match=r"Wrapper\.src \(dispatch\) and Wrapper\.dp \(main\)"):
        next(iter(loader))
    loader.shutdown()


def test_three_epochs_reuse_the_same_processes():
    loader = DataLoader2(pipelines.NoGraphWrapper(8), reading_service=MultiProcessingReadingService(2))
    try:
        epochs = [list(loader) for _ in range(3)]
    finally:
        loader.shutdown()
    for rows in epochs:
        assert_split(rows, 8)
    worker_sets = [{pids["worker"] for _, pids in rows} for rows in epochs]
    assert worker_sets[0] == worker_sets[1] == worker_sets[2]


def test_an_epoch_broken_off_early_does_not_leak_into_the_next():
    loader = DataLoader2(pipelines.sharded_pipe(50), reading_service=MultiProcessingReadingService(2))
    try:
        for i, _ in enumerate(loader):
            if i == 3:
                break
        rows = list(loader)
    finally:
        loader.shutdown()
    assert [value for value, _ in rows] == list(range(50))


def test_seed_reproduces_shuffles_in_dispatch_and_worker_segments():
    first = run(pipelines.shuffled_pipe(), epochs=2, seed=123)
    again = run(pipelines.shuffled_pipe(), epochs=2, seed=123)
    other = run(pipelines.shuffled_pipe(), epochs=2, seed=7)
    assert first == again
    assert first != other
    assert sorted(first[0]) == list(range(32))


def test_seeds_follow_torchdatas_scheme_exactly():
    from torchdata.dataloader2 import MultiProcessingReadingService as TorchdataService

    before = descendants()
    loader = DataLoader2(pipelines.shuffled_pipe(), reading_service=TorchdataService(2))
    loader.seed(123)
    try:
        expected = [list(loader) for _ in range(2)]
    finally:
        # torchdata's own service sometimes leaves a process running after shutdown(); that
        # is not this project's leak to report, so the reference ends its processes itself.
        shut_down(loader, before)
    assert run(pipelines.shuffled_pipe(), epochs=2, seed=123) == expected


def test_hooks_init_once_per_worker_reset_every_epoch():
    epochs = run(
        IterableWrapper(range(8)).sharding_filter(),
        epochs=3,
        worker_init_fn=pipelines.counting_init_fn,
        worker_reset_fn=pipelines.counting_reset_fn,
    )
    for number, rows in enumerate(epochs, start=1):
        assert sorted(item for item, _, _, _ in rows) == list(range(8))
        assert {pid for _, pid, _, _ in rows} != {os.getpid()}
        assert {init for _, _, init, _ in rows} == {1}
        assert {reset for _, _, _, reset in rows} == {number}


def test_worker_exception_keeps_type_and_reads_as_torchs():
    pipe = IterableWrapper(range(8)).sharding_filter().map(pipelines.fail_on_5)
    loader = DataLoader2(pipe, reading_service=MultiProcessingReadingService(2))
    with pytest.raises(ValueError) as info:
        list(loader)
    loader.shutdown()
    message = str(info.value)
    # torch's and torchdata's wording, which code and tests read.
    assert message.startswith("Caught ValueError in worker process 1 (pid ")
    assert "Original Traceback (most recent call last):" in message
    assert "in fail_on" in message  # the remote frames
    assert "\nValueError: bad sample 5" in message
    assert any("worker process 1" in note and "MapperIterDataPipe" in note for note in info.value.__notes__)


def test_dispatch_exception_reaches_the_main_process():
    pipe = pipelines.seed_pipe(IterableWrapper(range(8)).map(pipelines.fail_on_5))
    loader = DataLoader2(pipe, reading_service=MultiProcessingReadingService(2))
    with pytest.raises(ValueError) as info:
        list(loader)
    loader.shutdown()
    message = str(info.value)
    assert message.startswith("Caught ValueError in dispatching process (pid ")
    assert "Original Traceback (most recent call last):" in message
    assert "\nValueError: bad sample 5" in message


def test_zero_workers_runs_in_process():
    (rows,) = run(pipelines.sharded_pipe(5), num_workers=0)
    assert [value for value, _ in rows] == list(range(5))
    assert {pids["worker"] for _, pids in rows} == {os.getpid()}


def test_shutdown_leaves_no_child_process():
    me = psutil.Process()
    before = {p.pid for p in me.children()}
    loader = DataLoader2(pipelines.NoGraphWrapper(8), reading_service=MultiProcessingReadingService(2))
    next(iter(loader))
    started = [p for p in me.children() if p.pid not in before]
    assert len(started) == 3  # one dispatch process, two workers
    loader.shutdown()
    gone, alive = psutil.wait_procs(started, timeout=10)
    assert not alive


def test_iterating_after_shutdown_is_a_clear_error():
    service = MultiProcessingReadingService(2)
    loader = DataLoader2(pipelines.sharded_pipe(4), reading_service=service)
    list(loader)
    loader.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        list(loader)


def test_plan_is_exposed_by_the_running_service():
    loader = DataLoader2(pipelines.NoGraphWrapper(4), reading_service=MultiProcessingReadingService(2))
    try:
        list(loader)
        assert "dispatch process" in loader.reading_service.plan.explain()
    finally:
        loader.shutdown()


def test_inside_sequential_reading_service():
    service = SequentialReadingService(MultiProcessingReadingService(2))
    loader = DataLoader2(pipelines.sharded_pipe(6), reading_service=service)
    try:
        rows = list(loader)
    finally:
        loader.shutdown()
    assert_split(rows, 6, dispatch=False)


def test_planner_warnings_are_user_warnings():
    loader = DataLoader2(IterableWrapper(range(3)), reading_service=MultiProcessingReadingService(2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        items = list(loader)
    loader.shutdown()
    assert any(issubclass(w.category, UserWarning) and "No sharding point" in str(w.message) for w in caught)
    assert Counter(items) == {0: 2, 1: 2, 2: 2}
