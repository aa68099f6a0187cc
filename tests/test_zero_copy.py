"""Large tensors reach the training loop as views of shared memory, without a copy in the
main process; a loop that keeps every item (``list(loader)``) still completes, the
service copying once its users hold more than it lends."""

from __future__ import annotations

import functools

import pytest
import torch
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

import pipelines
from mprs_plus import MultiProcessingReadingService
from mprs_plus.runtime.main import service as service_module

ITEMS = 200  # 256 KiB each: 50 MiB per epoch, each worker's ring lent over six times
SMALL_RING = 4 << 20  # per worker channel: lends up to twice this to a holding user


def tensor_pipe(n: int = ITEMS):
    return IterableWrapper(range(n)).sharding_filter().map(pipelines.filled_tensor)


@pytest.fixture
def small_rings(monkeypatch):
    """Rings far smaller than one epoch's bytes, so that the hold limit is reached."""
    monkeypatch.setattr(service_module, "_DATA_BYTES", SMALL_RING)


@pytest.mark.parametrize("start_method", pipelines.INHERITED_AND_PICKLED)
@pytest.mark.timeout(120)
def test_a_loop_that_drops_its_items_receives_views_not_copies(small_rings, start_method):
    service = MultiProcessingReadingService(2, multiprocessing_context=start_method)
    loader = DataLoader2(tensor_pipe(), reading_service=service)
    try:
        seen = 0
        for item in loader:
            assert item.shape == (64 << 10,) and bool((item == item[0]).all())
            seen += 1
        large = loader.reading_service.stats().large_buffers
    finally:
        loader.shutdown()
    assert seen == ITEMS
    assert large.lent == ITEMS and large.copied == 0


@pytest.mark.timeout(120)
def test_a_loop_that_keeps_every_item_completes(small_rings):
    """``list(loader)`` over an epoch three times what the service lends: no deadlock, every
    item intact, the first ones still views, the rest copies."""
    loader = DataLoader2(tensor_pipe(), reading_service=MultiProcessingReadingService(2))
    try:
        kept = list(loader)
        large = loader.reading_service.stats().large_buffers
    finally:
        loader.shutdown()
    assert sorted(int(t[0]) for t in kept) == list(range(ITEMS))
    assert all(bool((t == t[0]).all()) for t in kept)
    assert large.lent + large.copied == ITEMS and large.lent > 0 and large.copied > 0
    # Each worker's channel lends up to twice its ring to a user who holds everything.
    assert large.held_bytes <= 2 * 2 * SMALL_RING + 2 * (256 << 10)


@pytest.mark.timeout(120)
def test_tensors_on_shared_memory_behave_as_ordinary_tensors():
    loader = DataLoader2(
        IterableWrapper(range(4)).sharding_filter().map(functools.partial(pipelines.filled_tensor, numel=1 << 20)),
        reading_service=MultiProcessingReadingService(2),
    )
    try:
        items = list(loader)
    finally:
        loader.shutdown()
    first = items[0]
    assert first.is_contiguous() and first.dtype == torch.float32
    assert torch.equal(first.pin_memory() if torch.cuda.is_available() else first.clone(), first)
    shared = first.clone().share_memory_()
    assert shared.is_shared() and torch.equal(shared, first)
    first += 1  # writable, like any tensor the loader hands out
    assert torch.equal(first, torch.full_like(first, float(int(items[0][0]))))


@pytest.mark.timeout(120)
def test_a_tensor_over_half_a_channels_lend_area_is_lent_without_pin_memory():
    """A 160 MiB tensor, in a worker channel's 256 MiB lend area: a service that does not
    pin leaves the area in one piece (only page-locked areas are cut into chunks, the
    largest half the area), so it arrives as a view, not copied through the ring. One per
    epoch: a second one read while the loop still holds the first would pass the held
    bound and be copied, as documented."""
    numel = 40 << 20  # float32: 160 MiB
    pipe = IterableWrapper([7]).sharding_filter().map(functools.partial(pipelines.filled_tensor, numel=numel))
    loader = DataLoader2(pipe, reading_service=MultiProcessingReadingService(1))
    try:
        seen = []
        for _ in range(2):
            for item in loader:
                assert item.numel() == numel and bool((item == 7).all())
                seen.append(int(item[0]))
            del item
        large = loader.reading_service.stats().large_buffers
    finally:
        loader.shutdown()
    assert seen == [7, 7]
    assert large.lent == 2 and large.copied == 0
