"""A batch of one large tensor is pickled once per dtype and shape: the next batches of that
name travel with the same stream, their bytes beside it, and arrive as pickling makes them."""

from __future__ import annotations

import enum
import pickle

import pytest
import torch

import mprs_plus.runtime  # noqa: F401  (registers the tensor reducer and the name, as the service does)
from mprs_plus.runtime import tensor_reducer
from mprs_plus.transport import register_reducer, register_stream_key
from mprs_plus.transport.serialize import Encoder

ITEMS = 3  # any int kind: the name holds it


def _sent(encoder, message):
    """What ``encoder`` sends for ``message``: its stream and its buffers' bytes."""
    stream, views = encoder.encode(message)
    try:
        return bytes(stream), [bytes(view) for view in views]
    finally:
        encoder.release()


def _pickled(message):
    """What pickling makes of ``message``, with no name looked up."""
    register_stream_key(None)
    try:
        return _sent(Encoder(), message)
    finally:
        register_stream_key(tensor_reducer.batch_stream_key)


BATCHES = [
    torch.randn(128, 256),
    torch.arange(4096, dtype=torch.int64).reshape(64, 64),
    torch.ones(8, 1 << 10, dtype=torch.uint8),
    torch.zeros(3, 5, 7, 11, dtype=torch.float64),
    torch.full((4096,), True),
    torch.randn(64, 64, dtype=torch.complex64),
]


@pytest.mark.parametrize("first", BATCHES, ids=lambda t: f"{t.dtype}{list(t.shape)}")
def test_a_named_batch_travels_as_pickling_makes_it(first):
    encoder = Encoder()
    second = first.clone().fill_(7) if first.dtype is not torch.bool else first.logical_not()
    message, again = (ITEMS, 2, [first]), (ITEMS, 2, [second])
    assert tensor_reducer.batch_stream_key(message) is not None
    assert _sent(encoder, message) == _pickled(message)  # pickled, and kept
    stream, buffers = _sent(encoder, again)  # the kept stream, the second batch's bytes
    assert (stream, buffers) == _pickled(again)
    kind, epoch, [out] = pickle.loads(stream, buffers=[bytearray(b) for b in buffers])
    assert (kind, epoch) == (ITEMS, 2) and out.dtype == second.dtype and torch.equal(out, second)


def test_the_second_batch_of_a_name_is_not_pickled():
    """Forced: a counting reducer for tensors, registered for the test. The first batch of
    a name is pickled, the next of that name is not; a reducer registered later forgets
    the kept streams (they may differ now), so the next batch is pickled again."""
    reduced = []

    def counting(tensor):
        reduced.append(tensor.shape)
        return tensor_reducer.reduce_tensor(tensor)

    class Other:
        pass

    register_reducer(torch.Tensor, counting)
    try:
        encoder = Encoder()
        _sent(encoder, (ITEMS, 0, [torch.randn(64, 64)]))
        _sent(encoder, (ITEMS, 0, [torch.randn(64, 64)]))
        assert len(reduced) == 1
        _sent(encoder, (ITEMS, 1, [torch.randn(64, 64)]))  # another epoch: another name
        _sent(encoder, (ITEMS, 0, [torch.randn(32, 128)]))  # another shape, same bytes
        assert len(reduced) == 3
        register_reducer(Other, lambda other: (Other, ()))
        stream, buffers = _sent(encoder, (ITEMS, 0, [torch.randn(64, 64)]))
        assert len(reduced) == 4
    finally:
        register_reducer(torch.Tensor, tensor_reducer.reduce_tensor)
    assert (stream, [len(b) for b in buffers]) == (_pickled((ITEMS, 0, [torch.zeros(64, 64)]))[0], [64 * 64 * 4])


class Kind(enum.IntEnum):
    ITEMS = ITEMS


big = torch.randn(64, 64)


@pytest.mark.parametrize(
    "message",
    [
        pytest.param((ITEMS, 0, [big, big]), id="two tensors: they may share a storage"),
        pytest.param((ITEMS, 0, (big,)), id="a tuple of items"),
        pytest.param((Kind.ITEMS, 0, [big]), id="a kind that is no plain int"),
        pytest.param((ITEMS, 0, [torch.randn(16, 16)]), id="small: its bytes go in the stream"),
        pytest.param((ITEMS, 0, [big.t()]), id="not contiguous"),
        pytest.param((ITEMS, 0, [big[1:]]), id="not from its storage's start"),
        pytest.param((ITEMS, 0, [big[:32]]), id="not to its storage's end"),
        pytest.param((ITEMS, 0, [big.clone().requires_grad_()]), id="autograd"),
        pytest.param((ITEMS, 0, [big.to(torch.bfloat16)]), id="a dtype numpy lacks"),
        pytest.param((ITEMS, 0, [torch.nn.Parameter(big.clone(), requires_grad=False)]), id="a subclass"),
        pytest.param((ITEMS, 0, [big.numpy()]), id="an array"),
        pytest.param((ITEMS, 0, [{"x": big}]), id="a dict of tensors"),
    ],
)
def test_anything_else_is_pickled_as_usual(message):
    assert tensor_reducer.batch_stream_key(message) is None
    encoder = Encoder()
    assert _sent(encoder, message) == _pickled(message)
    assert _sent(encoder, message) == _pickled(message)


def test_a_name_that_raises_leaves_the_message_to_pickling():
    def raising(message):
        raise RuntimeError("cannot name it")

    message = (ITEMS, 0, [torch.randn(64, 64)])
    register_stream_key(raising)
    try:
        sent = _sent(Encoder(), message)
    finally:
        register_stream_key(tensor_reducer.batch_stream_key)
    assert sent == _pickled(message)
