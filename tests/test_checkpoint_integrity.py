"""A damaged checkpoint, or one of another pipeline, is a ValueError naming the field,
never a silent resume that loses or reorders items.

Most cases edit a record and read it back (pure); two go through DataLoader2 with worker
processes, as a user would meet them.
"""

from __future__ import annotations

import pickle

import pytest
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2 import DataLoader2
from torchdata.dataloader2.random import SeedGenerator
from torchdata.datapipes.iter import IterableWrapper

import mprs_plus
from mprs_plus.plan import plan
from mprs_plus.resume_state import Phase, ResumeState
from mprs_plus.runtime.main.restore import Checkpoints, fingerprint

SEED = pickle.dumps(SeedGenerator(7))


def _square(x: int) -> int:
    return x * x


def _keep(x: int) -> bool:
    return x % 3 != 0


def _record(**changes: object) -> bytes:
    state = ResumeState(3, True, Phase.RUNNING, SEED, (5, 5, 4), 2, graph="0" * 32)
    record = pickle.loads(state.to_bytes())
    for name, value in changes.items():
        if value is _DROP:
            del record[name]
        else:
            record[name] = value
    return pickle.dumps(record)


_DROP = object()


def test_an_intact_record_reads_back():
    state = ResumeState.from_bytes(_record())
    assert state.consumed == (5, 5, 4) and state.next_worker == 2 and state.graph == "0" * 32


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_workers", _DROP),
        ("num_workers", -1),
        ("num_workers", "3"),
        ("in_order", _DROP),
        ("phase", "half-way"),
        ("consumed", _DROP),
        ("consumed", [5, 5]),  # a count per worker
        ("consumed", [5, -1, 4]),
        ("consumed", [5, 50, 4]),  # read in order, worker 1 cannot be that far ahead of worker 2
        ("consumed", [6, 5, 4]),
        ("next_worker", 3),  # out of range
        ("next_worker", -1),
        ("next_worker", _DROP),
        ("seed_state", b"not a pickle"),
        ("seed_state", None),  # an epoch under way needs it
        ("main_skip", 4),  # with per-worker counts
        ("graph", _DROP),
        ("graph", 12),
    ],
)
def test_each_damaged_field_is_a_value_error_naming_it(field, value):
    with pytest.raises(ValueError, match=f"field '{field}'"):
        ResumeState.from_bytes(_record(**{field: value}))


def test_a_finished_epoch_records_no_position():
    ended = pickle.loads(ResumeState(2, True, Phase.ENDED, graph="g").to_bytes())
    ResumeState.from_bytes(pickle.dumps(ended))
    ended["next_worker"] = 1
    with pytest.raises(ValueError, match="field 'next_worker'"):
        ResumeState.from_bytes(pickle.dumps(ended))


def test_counts_read_as_ready_need_not_follow_the_turns():
    ResumeState.from_bytes(_record(in_order=False, consumed=[1, 50, 4], next_worker=0))


def test_a_version_1_record_has_no_graph_and_still_loads():
    record = pickle.loads(_record())
    record["version"] = 1
    del record["graph"]
    assert ResumeState.from_bytes(pickle.dumps(record)).graph is None


def test_a_seed_state_that_is_not_a_seed_generator_is_refused():
    checkpoints = Checkpoints(3, True)
    with pytest.raises(ValueError, match="field 'seed_state'"):
        checkpoints.load(_record(seed_state=pickle.dumps([1, 2, 3])))


def test_the_fingerprint_follows_the_graph_not_where_it_runs():
    a = IterableWrapper(range(10)).sharding_filter().map(_square)
    b = IterableWrapper(range(10)).sharding_filter().filter(_keep)
    assert fingerprint(plan(a, 2)) == fingerprint(plan(IterableWrapper(range(99)).sharding_filter().map(_keep), 2))
    assert fingerprint(plan(a, 2)) != fingerprint(plan(b, 2))
    assert fingerprint(plan(a, 2)) == fingerprint(plan(a, 5))  # the worker count is its own field
    # Another split between processes is another graph for a checkpoint.
    dispatched = IterableWrapper(range(10)).sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING).map(_square)
    assert fingerprint(plan(dispatched, 2)) != fingerprint(plan(a, 2))


def _loader(pipe: object) -> DataLoader2:
    return DataLoader2(pipe, reading_service=mprs_plus.MultiProcessingReadingService(num_workers=2))


def _state_after(pipe: object, items: int) -> dict:
    loader = _loader(pipe)
    try:
        iterator = iter(loader)
        for _ in range(items):
            next(iterator)
        return loader.state_dict()
    finally:
        loader.shutdown()


def test_another_pipelines_checkpoint_is_refused():
    state = _state_after(IterableWrapper(range(40)).sharding_filter().map(_square), 7)
    other = _state_after(IterableWrapper(range(40)).sharding_filter().filter(_keep), 0)
    state["serialized_datapipe"] = other["serialized_datapipe"]
    restored = DataLoader2.from_state(state, mprs_plus.MultiProcessingReadingService(num_workers=2))
    try:
        with pytest.raises(ValueError, match="another pipeline.*field 'graph'"):
            next(iter(restored))
    finally:
        restored.shutdown()


def test_a_next_worker_out_of_range_is_refused_before_any_process_starts():
    state = _state_after(IterableWrapper(range(40)).sharding_filter().map(_square), 7)
    record = pickle.loads(state["reading_service_state"])
    record["next_worker"] = 2
    state["reading_service_state"] = pickle.dumps(record)
    restored = DataLoader2.from_state(state, mprs_plus.MultiProcessingReadingService(num_workers=2))
    try:
        with pytest.raises(ValueError, match="field 'next_worker'.*2 is not a worker of num_workers=2"):
            next(iter(restored))
    finally:
        restored.shutdown()
