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
