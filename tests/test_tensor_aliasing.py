"""Tensors of one item that share a storage arrive sharing one storage, as with torchdata;
a small view of a big tensor travels as its own bytes (never the whole storage)."""

from __future__ import annotations

import pickle

import pytest
import torch
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

import mprs_plus.runtime  # noqa: F401  (registers the tensor reducer, as the service does)
import pipelines
from mprs_plus import MultiProcessingReadingService
from mprs_plus.transport.serialize import Encoder


def encoded(value):
    encoder = Encoder()
    stream, views = encoder.encode(value)
    out = pickle.loads(bytes(stream), buffers=[bytearray(view) for view in views])
    sent = sum(view.nbytes for view in views)
    encoder.release()
    return out, sent


def same_storage(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_views_of_one_tensor_arrive_on_one_storage_sent_once():
    x = torch.randn(256, 256)
    (a, b, c), sent = encoded((x, x.t(), x.view(-1)))
    assert same_storage(a, b) and same_storage(a, c)
    assert sent == x.numel() * 4  # the storage travels once
    a[3, 5] = 42.0
    assert b[5, 3] == 42.0 and c[3 * 256 + 5] == 42.0
    assert torch.equal(b.t(), a)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.bool, torch.complex64])
def test_a_storage_and_its_tensors_travel_once_whatever_the_dtype(dtype):
    # bfloat16 has no numpy twin, so it is rebuilt by another path than the others.
    x = torch.randn(64, 64).to(dtype)
    (a, b, rows, storage), sent = encoded((x, x.t(), x[16:], x.untyped_storage()))
    assert sent == x.untyped_storage().nbytes()
    assert torch.equal(a, x) and torch.equal(b, x.t()) and torch.equal(rows, x[16:])
    assert rows.storage_offset() == 16 * 64 and same_storage(a, rows) and same_storage(a, b)
    assert storage.data_ptr() == a.untyped_storage().data_ptr()
    a[20, 3] = b[0, 0] if dtype is torch.bool else 7
    assert b[3, 20] == a[20, 3] and rows[4, 3] == a[20, 3]


def test_a_small_view_of_a_big_tensor_sends_only_its_bytes():
    big = torch.randn(2000, 1000)
    out, sent = encoded(big[5:7])
    assert torch.equal(out, big[5:7]) and sent == 2 * 1000 * 4


def test_aliasing_survives_the_service():
    pipe = IterableWrapper(range(4)).sharding_filter().map(pipelines.tensor_and_views)
    loader = DataLoader2(pipe, reading_service=MultiProcessingReadingService(2))
    try:
        items = list(loader)
    finally:
        loader.shutdown()
    assert len(items) == 4
    for item in items:
        base = item["base"]
        assert same_storage(base, item["transposed"]) and same_storage(base, item["flat"])
        offset = base[0, 0].item()
        item["flat"][4] = -1.0
        assert base[1, 0] == -1.0 and item["transposed"][0, 1] == -1.0
        # A third of the storage: it travelled as its own bytes, so it is a copy.
        assert item["row"].tolist() == [offset + 4, offset + 5, offset + 6, offset + 7]
