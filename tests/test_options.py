"""The service's arguments: torchdata's first, in torchdata's order; ours keyword-only and
validated up front; the dispatch process's hook and buffer."""

from __future__ import annotations

import inspect
import os

import pytest
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2 import DataLoader2
from torchdata.dataloader2 import MultiProcessingReadingService as TorchdataService
from torchdata.datapipes.iter import IterableWrapper

import pipelines
from mprs_plus import MultiProcessingReadingService
from mprs_plus.backends import local as local_backend


def test_torchdata_arguments_come_first_in_torchdatas_order():
    ours = inspect.signature(MultiProcessingReadingService).parameters
    theirs = inspect.signature(TorchdataService).parameters
    assert list(ours)[: len(theirs)] == list(theirs)
    for name, parameter in theirs.items():
        assert ours[name].default == parameter.default, name
    extra = list(ours)[len(theirs) :]
    assert extra == ["dispatch_init_fn", "dispatch_buffer_size", "in_order", "timeout", "collect_stats", "stats_interval", "backend",
                     "pin_memory", "device", "device_prefetch", "worker_restarts", "timeline"]
    assert all(ours[name].kind is inspect.Parameter.KEYWORD_ONLY for name in extra)


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"dispatch_buffer_size": 0}, ValueError, "dispatch_buffer_size must be >= 1"),
        ({"dispatch_buffer_size": -2}, ValueError, "dispatch_buffer_size must be >= 0"),
        ({"dispatch_buffer_size": 2.5}, TypeError, "dispatch_buffer_size must be an int"),
        ({"in_order": "yes"}, TypeError, "in_order must be True or False"),
        ({"dispatch_init_fn": 3}, TypeError, "dispatch_init_fn must be callable"),
        ({"backend": "ray"}, TypeError, "backend must be a backend such as mprs_plus.RayBackend"),
        ({"pin_memory": 1}, TypeError, "pin_memory must be True or False"),
        ({"device": "cuda"}, ValueError, "pass pin_memory=True as well"),
        ({"device": "cpu", "pin_memory": True}, ValueError, "leave device=None"),
        ({"device": 3, "pin_memory": True}, TypeError, "device must be a device name"),
        ({"device_prefetch": 0}, ValueError, "device_prefetch must be >= 1"),
    ],
)
def test_new_options_are_validated_at_construction(kwargs, error, text):
    with pytest.raises(error, match=text):
        MultiProcessingReadingService(2, **kwargs)


def test_dispatch_init_fn_runs_once_in_the_dispatch_process():
    pipelines.COUNTS.clear()
    service = MultiProcessingReadingService(2, dispatch_init_fn=pipelines.dispatch_init)
    pipe = IterableWrapper(range(6)).sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    loader = DataLoader2(pipe.map(pipelines.identity), reading_service=service)
    try:
        epochs = [list(loader) for _ in range(2)]
    finally:
        loader.shutdown()
    for rows in epochs:
        assert [item for item, _, _, _ in rows] == list(range(6))
        (pid,) = {pid for _, pid, _, _ in rows}
        assert pid != os.getpid()
        assert {(count, info) for _, _, count, info in rows} == {(1, (2, 0))}
    assert pipelines.COUNTS == {}  # never in the main process


def test_a_failing_dispatch_init_fn_is_reported():
    service = MultiProcessingReadingService(2, dispatch_init_fn=pipelines.wrong_init)
    loader = DataLoader2(pipelines.plain_pipe(range(6), dispatch=True), reading_service=service)
    with pytest.raises(AttributeError, match="outputs"):
        list(loader)
    loader.shutdown()


@pytest.mark.parametrize("buffer, expected", [(None, 10), (3, 3)])
def test_dispatch_buffer_size_sets_the_dispatch_channels(monkeypatch, buffer, expected):
    opened = []

    def recording_open_channel(ctx, *, capacity_items=0, capacity_bytes=0, **more):
        opened.append(capacity_items)
        return real_open_channel(ctx, capacity_items=capacity_items, capacity_bytes=capacity_bytes, **more)

    real_open_channel = local_backend.open_channel
    monkeypatch.setattr(local_backend, "open_channel", recording_open_channel)
    service = MultiProcessingReadingService(2, dispatch_buffer_size=buffer)
    loader = DataLoader2(pipelines.plain_pipe(range(7), dispatch=True), reading_service=service)
    try:
        assert list(loader) == [2 * i for i in range(7)]
    finally:
        loader.shutdown()
    # The dispatch process's control, then per worker: control, data, dispatch -> worker.
    assert len(opened) == 7
    assert opened[3::3] == [expected, expected]


def test_torchdatas_public_attributes_read_as_torchdatas():
    kwargs = dict(
        num_workers=3,
        multiprocessing_context="spawn",
        worker_prefetch_cnt=4,
        main_prefetch_cnt=0,
        worker_init_fn=pipelines.identity,
        worker_reset_fn=pipelines.identity,
    )
    ours, theirs = MultiProcessingReadingService(**kwargs), TorchdataService(**kwargs)
    for name in kwargs:
        assert getattr(ours, name) == getattr(theirs, name), name
    defaults, their_defaults = MultiProcessingReadingService(), TorchdataService(1)
    for name in ("multiprocessing_context", "worker_prefetch_cnt", "main_prefetch_cnt", "worker_init_fn"):
        assert getattr(defaults, name) == getattr(their_defaults, name), name
    with pytest.raises(AttributeError):
        ours.worker_prefetch_cnt = 1  # validated once: read-only
