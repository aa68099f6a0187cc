"""Graphs torchdata's service refuses or collapses: several worker outputs (branches joined
in the main process) and several dispatchers, planned and run as written."""

from __future__ import annotations

import functools
import os
import warnings

import pytest
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

import pipelines
from mprs_plus import MultiProcessingReadingService, Segment, plan


def run(datapipe, epochs=1, **options):
    options.setdefault("num_workers", 2)
    loader = DataLoader2(datapipe, reading_service=MultiProcessingReadingService(**options))
    try:
        return [list(loader) for _ in range(epochs)]
    finally:
        loader.shutdown()


# -- planning (no processes) ------------------------------------------------------------------


def test_two_branches_joined_in_main_are_two_worker_outputs():
    p = plan(pipelines.branch_pipes(), num_workers=2)
    assert len(p.worker_outputs) == 2 and not p.dispatchers and not p.warnings
    assert p.segments[0] is Segment.MAIN
    text = p.explain()
    assert "worker output 1 of 2," in text and "worker output 2 of 2," in text
    assert "a thread per output in each worker" in text


def test_two_dispatchers_keep_their_own_queues():
    p = plan(pipelines.two_dispatchers(), num_workers=2)
    assert len(p.dispatchers) == 2 and len(p.worker_outputs) == 1 and not p.warnings
    text = p.explain()
    assert "dispatcher 1 of 2," in text and "dispatcher 2 of 2," in text
    assert "(1 dispatch, 2 workers, 1 main)" in text


def test_a_branch_without_sharding_point_is_named():
    left = IterableWrapper(range(4)).sharding_filter()
    right = IterableWrapper(range(4)).map(abs)
    p = plan(pipelines.JoinInMain(left, right), num_workers=2)
    (warning,) = p.warnings
    assert "branch ending at #" in warning and "MapperIterDataPipe" in warning


def test_a_dispatcher_nested_in_the_dispatch_segment_is_not_a_boundary():
    inner = IterableWrapper(range(6)).sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    outer = inner.map(abs).sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    p = plan(pipelines.NonReplicable(outer.map(abs)), num_workers=2)
    assert p.dispatchers == (p.graph.datapipes.index(outer),)
    (rows,) = run(pipelines.NonReplicable(outer.map(abs)))
    assert rows == list(range(6))


# -- running ---------------------------------------------------------------------------------


@pytest.mark.parametrize("in_order", [True, False], ids=["in_order", "as_ready"])
def test_two_sharded_branches_joined_by_a_non_replicable_zip(in_order):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        epochs = run(pipelines.branch_pipes(10), epochs=2, in_order=in_order)
    for rows in epochs:
        assert sorted(a[1] for a, _ in rows) == list(range(10))
        assert sorted(b[1] for _, b in rows) == list(range(100, 110))
        assert len({a[2] for a, _ in rows} | {b[2] for _, b in rows} | {os.getpid()}) == 3
        if in_order:
            # Deterministic, and each pair made by one worker: both branches are sharded alike.
            assert [(a[1], b[1]) for a, b in rows] == [(i, 100 + i) for i in range(10)]
            assert all(a[2] == b[2] for a, b in rows)
    # As ready, a join by position pairs items by arrival: the service says so.
    assert any("pairs items by arrival" in str(w.message) for w in caught) is not in_order


def test_two_dispatchers_feeding_one_worker_segment():
    epochs = run(pipelines.two_dispatchers(10), epochs=2)
    for rows in epochs:
        assert [(first[0], second) for _, (first, second), _ in rows] == [(i, 100 + i) for i in range(10)]
        dispatch = {first[1]["pre"] for _, (first, _), _ in rows}
        workers = {pid for _, _, pid in rows}
        assert len(dispatch) == 1 and len(workers) == 2 and not (dispatch | workers) & {os.getpid()}


@pytest.mark.parametrize("factory", [pipelines.shared_in_workers, pipelines.shared_in_dispatch])
def test_branches_sharing_upstream_datapipes(factory):
    (rows,) = run(factory(12), epochs=1)
    assert [(a[1], b) for a, b in rows] == [(i, 2 * i) for i in range(12)]


def test_worker_init_fn_gets_every_output():
    (rows,) = run(pipelines.branch_pipes(6), worker_init_fn=pipelines.map_outputs)
    assert sorted(a[1][1] for a, _ in rows) == list(range(6))
    assert {a[0] for a, _ in rows} == {"init0", "init1"}
    assert all(a[0] == b[0] for a, b in rows)


def test_a_hook_that_drops_outputs_is_a_clear_error():
    with pytest.raises(TypeError, match="2 outputs.*SegmentOutputs"):
        run(pipelines.branch_pipes(6), worker_init_fn=pipelines.wrong_init)


def test_an_error_in_one_branch_reaches_the_main_process():
    left = IterableWrapper(range(8)).sharding_filter()
    right = IterableWrapper(range(8)).sharding_filter().map(pipelines.fail_on_5)
    with pytest.raises(ValueError, match="bad sample 5"):
        run(pipelines.JoinInMain(left, right))


@pytest.mark.timeout(60)
def test_two_threads_of_the_main_process_read_two_outputs_at_once():
    """Each thread waits for its own output's channels: neither may keep the other
    waiting (a reader that wants a channel outside another's wait interrupts it)."""
    left = IterableWrapper(range(300)).sharding_filter().map(functools.partial(pipelines.tag, label="a"))
    right = IterableWrapper(range(300)).sharding_filter().map(pipelines.big)
    pipe = pipelines.ThreadedJoin(left, right)
    for epoch in run(pipe, epochs=2):
        assert [(a[1], b[0]) for a, b in epoch] == [(i, i) for i in range(300)]


# -- no deadlock when an epoch is abandoned with full channels -----------------------------------


@pytest.mark.timeout(60)
def test_abandoned_epoch_with_full_channels_on_two_outputs():
    """A lane blocked on a full channel of the abandoned epoch must not keep the worker
    from starting the next one while the main process waits on the other output."""
    left = IterableWrapper(range(40)).sharding_filter()
    right = IterableWrapper(range(40)).sharding_filter().map(pipelines.big)
    pipe = pipelines.JoinInMain(left, right).map(pipelines.first_and_size)
    loader = DataLoader2(pipe, reading_service=MultiProcessingReadingService(2))
    try:
        for epoch in range(3):
            for _ in loader:
                break  # abandon the epoch: right's lanes stay blocked on full channels
        rows = list(loader)
    finally:
        loader.shutdown()
    assert rows == [(i, i, 200_000) for i in range(40)]


@pytest.mark.timeout(60)
def test_abandoned_epoch_with_a_dispatcher_blocked_on_stale_items():
    """The worker reads the second dispatcher first; the first one is blocked on stale
    items of the abandoned epoch, and must be drained for the dispatch process to reset."""
    first = IterableWrapper(range(40)).map(pipelines.big)
    first = first.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    second = IterableWrapper(range(40)).sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    pipe = pipelines.NonReplicable(second.zip(first).map(pipelines.first_and_size))
    loader = DataLoader2(pipe, reading_service=MultiProcessingReadingService(2, dispatch_buffer_size=2))
    try:
        for epoch in range(3):
            for _ in loader:
                break
        rows = list(loader)
    finally:
        loader.shutdown()
    assert rows == [(i, i, 200_000) for i in range(40)]


def test_as_ready_with_a_slow_branch_still_yields_every_pair():
    slow = IterableWrapper(range(16)).sharding_filter().map(functools.partial(pipelines.tag, label="s"))
    fast = IterableWrapper(range(16)).sharding_filter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (rows,) = run(pipelines.JoinInMain(slow, fast), in_order=False, num_workers=3)
    assert sorted(a[1] for a, _ in rows) == sorted(b for _, b in rows) == list(range(16))


@pytest.mark.parametrize("start_method", pipelines.INHERITED_AND_PICKLED)
def test_several_outputs_and_dispatchers_inherited_and_pickled(start_method):
    epochs = run(pipelines.mixed_pipe(8), epochs=2, multiprocessing_context=start_method)
    for rows in epochs:
        assert [(dealt[1], sharded) for dealt, sharded in rows] == [((i, 2 * i), 100 + i) for i in range(8)]
