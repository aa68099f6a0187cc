"""The channels under the reading service: tensors and arrays through DataLoader2 workers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from mprs_plus import MultiProcessingReadingService


def make_sample(i: int) -> dict:
    return {"index": i, "image": torch.full((3, 64, 64), float(i)).transpose(1, 2), "mask": np.full(5000, i)}


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_samples_cross_the_workers_intact_and_in_order(method):
    pipe = IterableWrapper(range(24)).sharding_filter().map(make_sample)
    service = MultiProcessingReadingService(num_workers=2, multiprocessing_context=method)
    loader = DataLoader2(pipe, reading_service=service)
    try:
        for _ in range(2):  # two epochs on the same processes
            samples = list(loader)
            assert [s["index"] for s in samples] == list(range(24))
            for sample in samples:
                expected = make_sample(sample["index"])
                assert torch.equal(sample["image"], expected["image"])
                assert np.array_equal(sample["mask"], expected["mask"])
    finally:
        loader.shutdown()


@pytest.mark.parametrize(("lanes", "dispatchers", "refilled"), [(1, 0, True), (2, 0, False), (1, 1, False)])
def test_a_worker_refills_its_channel_at_half_only_where_no_reader_waits_on_its_next_item(lanes, dispatchers, refilled):
    # Asleep until half its channel is read, a worker whose next item another process
    # waits for (through a dispatcher, or lanes sharing a source) could hold up a reader
    # that read one item and then waits for that process: there it wakes at every read.
    import multiprocessing

    from mprs_plus.backends.local import LocalPlacement
    from mprs_plus.options import Options
    from mprs_plus.runtime.main.service import _open_worker_ends
    from mprs_plus.transport import _ring
    from transport_peers import TRANSPORT

    if TRANSPORT != "shm":
        pytest.skip("looks inside the shared-memory transport")
    ends = _open_worker_ends(LocalPlacement(multiprocessing.get_context("fork")), Options(num_workers=1), lanes, dispatchers)
    try:
        assert [bool(rx._ctl[_ring.REFILL_HALF]) for rx in ends.receivers] == [refilled] * lanes
        assert not any(rx._ctl[_ring.REFILL_HALF] for rx in ends.inputs)
    finally:
        for end in (ends.control, ends.control_rx, *ends.senders, *ends.receivers, *ends.dealt, *ends.inputs):
            end.close()
