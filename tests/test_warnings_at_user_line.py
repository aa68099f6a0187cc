"""Every warning the service issues names the user's line, not torchdata's or ours."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

import pipelines
from mprs_plus import MultiProcessingReadingService
from mprs_plus.user_frame import user_stacklevel


def _warnings_of_a_first_iteration(pipe, **options):
    loader = DataLoader2(pipe, reading_service=MultiProcessingReadingService(2, **options))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = inspect.currentframe().f_lineno + 1
            items = list(loader)  # the user's line: the one every warning must name
    finally:
        loader.shutdown()
    return items, caught, line


def _ours(caught, text):
    found = [w for w in caught if text in str(w.message)]
    assert found, [str(w.message)[:80] for w in caught]
    return found


def test_a_plan_warning_names_the_users_line():
    items, caught, line = _warnings_of_a_first_iteration(IterableWrapper(range(4)).map(pipelines.double))
    assert sorted(items) == sorted([0, 2, 4, 6] * 2)  # no sharding point: each worker yields all
    for w in _ours(caught, "No sharding point"):
        assert (w.filename, w.lineno) == (__file__, line), (w.filename, w.lineno)


@pytest.mark.skipif(torch.cuda.is_available(), reason="warns only where there is no accelerator")
def test_pin_memory_without_an_accelerator_names_the_users_line():
    _, caught, line = _warnings_of_a_first_iteration(IterableWrapper(range(4)).sharding_filter(), pin_memory=True)
    for w in _ours(caught, "no accelerator is available"):
        assert (w.filename, w.lineno) == (__file__, line), (w.filename, w.lineno)


def test_the_walk_stops_at_the_first_frame_outside_the_libraries():
    def helper_of_the_user():
        return user_stacklevel()

    # Called from this test file, nothing is skipped: the caller of warnings.warn is level 1.
    assert helper_of_the_user() == 1
