"""Send CPU tensors through the channels as raw bytes, not with torch's own pickling.

torch's default reduction copies the storage into the pickle stream (5.5 ms per 4 MiB
here). This one hands the transport the bytes the tensor covers as one out-of-band
buffer, which the channel copies straight into shared memory:

    tensor --> (dtype name, shape, strides | None, PickleBuffer of the bytes it spans)
           --> frombuffer(bytes).view(dtype) --as_strided / view--> tensor

A tensor whose elements fill the storage span they cover (contiguous, transposed,
permuted, expanded) keeps its strides and is sent with the bytes it spans (or its
storage, see below: at most twice those bytes); a sparse view
(``t[:, 0]`` of a big matrix) is made contiguous first, so no unused bytes travel.

Storage sharing within one message is kept: a dense tensor that covers at least half of
its storage travels as a view of that storage, and the storage is pickled by its own
reducer, so pickle's memo sends it once per message and every tensor built on it arrives
built on one storage again (``x`` and ``x.t()`` stay aliased, as with torchdata). It costs
about 1 us per small tensor (a round trip of 64 tensors of 16 floats: 12 us per tensor
instead of 11, measured on a 2-core machine); for a large tensor the copy of its bytes
dominates, and an aliased pair sends its storage once instead of twice. A smaller view
(``x[0]`` of a big ``x``) still travels as its own bytes, so that sending a slice never
sends the whole storage; it then arrives as a copy, not aliased.

Anything unusual (another device, autograd, quantized, conjugate / negative bits,
sparse layouts, subclasses) falls back to torch's pickling, which knows how.

Importing this module registers the reducers (tensors, storages); ``mprs_plus.runtime`` imports it, so every
process of the service has it, whatever its start method.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from ..transport import register_reducer

_DTYPES: dict[str, torch.dtype] = {
    str(value).removeprefix("torch."): value for value in vars(torch).values() if isinstance(value, torch.dtype)
}


def reduce_tensor(tensor: torch.Tensor) -> str | tuple[Any, ...]:
    if (
        tensor.device.type != "cpu"
        or tensor.layout is not torch.strided
        or tensor.requires_grad
        or tensor.is_quantized
        or tensor.is_conj()
        or tensor.is_neg()
    ):
        return tensor.__reduce_ex__(5)
    dtype = str(tensor.dtype).removeprefix("torch.")
    shape = tuple(tensor.shape)
    numel = tensor.numel()
    if numel == 0:
        return _rebuild_empty, (dtype, shape)
    strides: tuple[int, ...] | None = tensor.stride()
    span = 1 + sum((size - 1) * stride for size, stride in zip(shape, strides))
    if span <= numel:
        storage = tensor.untyped_storage()
        if 2 * span * tensor.element_size() >= storage.nbytes():
            return _rebuild_on_storage, (storage, dtype, shape, strides, tensor.storage_offset())
        # Dense (or overlapping, as when expanded): the bytes it covers are all useful.
        flat = tensor.as_strided((span,), (1,), tensor.storage_offset())
        if tensor.is_contiguous():
            strides = None
    else:
        flat = tensor.contiguous().view(-1)
        strides = None
    raw = flat.view(torch.uint8).numpy()  # a view: no copy until the channel's
    return _rebuild_tensor, (pickle.PickleBuffer(raw), dtype, shape, strides)


def _rebuild_tensor(buffer: Any, dtype: str, shape: tuple[int, ...], strides: tuple[int, ...] | None) -> torch.Tensor:
    flat = torch.frombuffer(buffer, dtype=torch.uint8).view(_DTYPES[dtype])
    if strides is None:
        return flat.view(shape)
    return flat.as_strided(shape, strides)


def _rebuild_empty(dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(shape, dtype=_DTYPES[dtype])


def _rebuild_on_storage(
    storage: torch.UntypedStorage, dtype: str, shape: tuple[int, ...], strides: tuple[int, ...], offset: int
) -> torch.Tensor:
    return torch.empty((0,), dtype=_DTYPES[dtype]).set_(storage, offset, shape, strides)


def reduce_storage(storage: torch.UntypedStorage) -> str | tuple[Any, ...]:
    """A CPU storage as one buffer of its bytes (pickled once per message, see above)."""
    if storage.device.type != "cpu":
        return storage.__reduce_ex__(5)
    if storage.nbytes() == 0:
        return torch.UntypedStorage, (0,)
    raw = torch.empty((0,), dtype=torch.uint8).set_(storage).numpy()  # a view: no copy
    return _rebuild_storage, (pickle.PickleBuffer(raw),)


def _rebuild_storage(buffer: Any) -> torch.UntypedStorage:
    return torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()


register_reducer(torch.Tensor, reduce_tensor)
register_reducer(torch.UntypedStorage, reduce_storage)
