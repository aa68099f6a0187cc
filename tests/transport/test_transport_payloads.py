"""numpy arrays and torch tensors cross a channel exactly, and large ones out of band."""

from __future__ import annotations

import multiprocessing
import weakref

import numpy as np
import pytest
import torch

import mprs_plus.runtime  # noqa: F401  (registers the tensor reducer, as the service does)
from mprs_plus.runtime.tensor_reducer import reduce_tensor
from mprs_plus.transport import open_channel
from mprs_plus.transport.serialize import INLINE_LIMIT, Encoder

FORK = multiprocessing.get_context("fork")


@pytest.fixture(scope="module")
def channel():
    sender, receiver = open_channel(FORK, capacity_items=8, capacity_bytes=32 << 20)
    yield sender, receiver
    sender.close()
    receiver.close()


def round_trip(channel, value):
    sender, receiver = channel
    sender.send(value)
    return receiver.recv(timeout=10)


# -- numpy ------------------------------------------------------------------------------

ARRAYS = {
    "float64 big": np.random.default_rng(0).random((300, 400)),
    "float32 small": np.arange(12, dtype=np.float32).reshape(3, 4),
    "int8": np.arange(-100, 100, dtype=np.int8),
    "uint64": np.array([0, 2**64 - 1], dtype=np.uint64),
    "bool": np.array([True, False, True]),
    "float16": np.linspace(0, 1, 5000, dtype=np.float16),
    "complex128": np.array([1 + 2j, -3j]),
    "big endian": np.arange(2000, dtype=">i4"),
    "datetime64": np.array(["2024-01-01", "2025-06-30"], dtype="datetime64[ns]"),
    "unicode": np.array(["a", "bcd", "ü"]),
    "bytes": np.array([b"ab", b"c"]),
    "fortran": np.asfortranarray(np.arange(20_000, dtype=np.float64).reshape(100, 200)),
    "strided": np.arange(40_000, dtype=np.int32)[::3],
    "transposed 3d": np.arange(24_000, dtype=np.float32).reshape(20, 30, 40).transpose(2, 0, 1),
    "0-d": np.array(3.5),
    "empty": np.empty((0, 5), dtype=np.float32),
    "structured": np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")]),
    "object": np.array([1, "a", None], dtype=object),
}


@pytest.mark.parametrize("name", ARRAYS)
def test_numpy_arrays_round_trip_exactly(channel, name):
    array = ARRAYS[name]
    out = round_trip(channel, array)
    assert type(out) is np.ndarray
    assert out.dtype == array.dtype and out.shape == array.shape
    if array.dtype != object:
        assert out.tobytes() == array.tobytes()
    else:
        assert out.tolist() == array.tolist()
    if array.nbytes >= INLINE_LIMIT:
        assert out.flags.writeable


def test_a_numpy_array_costs_a_short_header_and_one_buffer():
    array = np.zeros(1 << 20, dtype=np.float32)
    stream, buffers = Encoder().encode(array)
    assert len(buffers) == 1 and buffers[0].nbytes == array.nbytes
    assert len(stream) < 200


def test_many_arrays_in_one_message(channel):
    arrays = [np.full(1000 + i, i, dtype=np.int64) for i in range(50)]
    out = round_trip(channel, {"batch": arrays, "labels": list(range(50))})
    assert all(np.array_equal(a, b) for a, b in zip(out["batch"], arrays))


# -- torch ------------------------------------------------------------------------------


def _base(dtype: torch.dtype, shape: tuple[int, ...] = (6, 7)) -> torch.Tensor:
    values = torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape) - 20
    if dtype == torch.bool:
        return values > 0
    if dtype.is_complex:
        return torch.complex(values, -values).to(dtype)
    if dtype in (torch.uint8,):
        return values.abs().to(dtype)
    return values.to(dtype)


DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_dtypes_round_trip_exactly(channel, dtype):
    for shape in [(6, 7), (64, 128)]:  # in the stream, and out of band
        tensor = _base(dtype, shape)
        out = round_trip(channel, tensor)
        assert out.dtype == dtype and out.shape == tensor.shape
        assert torch.equal(out, tensor)


LAYOUTS = {
    "contiguous": lambda: torch.randn(256, 300),
    "transposed": lambda: torch.randn(256, 300).t(),
    "permuted": lambda: torch.randn(8, 16, 32).permute(2, 0, 1),
    "column": lambda: torch.randn(512, 300)[:, 3],
    "stepped": lambda: torch.arange(100_000)[::7],
    "offset slice": lambda: torch.randn(100, 100)[10:20, 5:50],
    "expanded": lambda: torch.randn(1, 300).expand(400, 300),
    "0-d": lambda: torch.tensor(2.5),
    "empty": lambda: torch.empty(0, 3),
    "empty strided": lambda: torch.empty(4, 0, 2).transpose(0, 2),
    "narrow of big": lambda: torch.randn(2000, 1000)[5:7],
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_tensor_layouts_round_trip_exactly(channel, name):
    tensor = LAYOUTS[name]()
    out = round_trip(channel, tensor)
    assert type(out) is torch.Tensor
    assert out.shape == tensor.shape and out.dtype == tensor.dtype
    assert torch.equal(out, tensor)
    if tensor.numel() and name != "expanded":  # an expanded view refuses in-place writes, as the original does
        out.add_(1)  # writable


def test_dense_views_keep_their_strides_and_sparse_views_send_only_their_elements():
    transposed = torch.randn(64, 128).t()
    _, ((buffer,), _, _, strides, _) = reduce_tensor(transposed)  # sent with its storage
    assert strides == transposed.stride() and buffer.raw().nbytes == transposed.numel() * 4
    narrow = torch.randn(2000, 1000)[5:7]  # a small dense view: only its own bytes
    _, ((buffer,), _, _, strides, _) = reduce_tensor(narrow)
    assert strides is None and buffer.raw().nbytes == narrow.numel() * 4
    column = torch.randn(512, 300)[:, 3]
    _, ((buffer,), _, _, strides, _) = reduce_tensor(column)
    assert strides is None and buffer.raw().nbytes == 512 * 4


def test_a_big_tensor_costs_a_short_header_and_one_buffer():
    tensor = torch.zeros(1 << 20)
    stream, buffers = Encoder().encode(tensor)
    assert len(buffers) == 1 and buffers[0].nbytes == tensor.numel() * 4
    assert len(stream) < 300  # torch's own pickling would put the 4 MiB in the stream


def test_a_storage_goes_once_per_message_and_the_encoder_keeps_none_after_it():
    encoder = Encoder()
    tensor = torch.randn(64, 128)
    for _ in range(2):  # each message carries the bytes again: nothing is remembered across
        _, buffers = encoder.encode((tensor, tensor.t(), tensor.untyped_storage()))
        assert [buffer.nbytes for buffer in buffers] == [64 * 128 * 4]
        encoder.release()
    storage = weakref.ref(tensor.untyped_storage())
    del tensor
    assert storage() is None


def test_unusual_tensors_fall_back_to_torch_pickling(channel):
    grad = torch.randn(3, requires_grad=True)
    out = round_trip(channel, grad)
    assert out.requires_grad and torch.equal(out.detach(), grad.detach())
    parameter = torch.nn.Parameter(torch.randn(4))
    out = round_trip(channel, parameter)
    assert isinstance(out, torch.nn.Parameter) and torch.equal(out.data, parameter.data)
    conj = torch.tensor([1 + 1j, 2 - 1j]).conj()
    assert torch.equal(round_trip(channel, conj), conj)
    sparse = torch.eye(3).to_sparse()
    assert torch.equal(round_trip(channel, sparse).to_dense(), torch.eye(3))


def test_tensors_nested_in_batches(channel):
    batch = {"x": torch.randn(16, 3, 32, 32), "y": torch.arange(16), "meta": [torch.tensor(i) for i in range(3)]}
    out = round_trip(channel, batch)
    assert torch.equal(out["x"], batch["x"]) and torch.equal(out["y"], batch["y"])
    assert all(torch.equal(a, b) for a, b in zip(out["meta"], batch["meta"]))
