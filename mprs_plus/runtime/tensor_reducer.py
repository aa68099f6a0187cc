"""Send CPU tensors through the channels as raw bytes, not with torch's own pickling.

torch's default reduction copies the storage into the pickle stream, an extra copy of
every byte. This one hands the transport the bytes the tensor covers as one out-of-band
buffer, which the channel copies straight into shared memory:

    tensor --> (bytes | dtype name, shape, strides | None, storage offset)
           --> torch.from_numpy(numpy array over the bytes) [--as_strided--> tensor]

The receiving side is the main process, whose CPU time per item is what a training loop
pays, and between two items its caches are cold (the workers' copies sweep them): each
torch call there is a trip through its dispatcher, dear with cold caches, so the usual
tensor (contiguous, filling its storage) is rebuilt with one numpy array and one
``from_numpy``, about half the cost of an ``UntypedStorage`` and ``set_`` (figures in
docs/benchmarks-history.md, Design figures). dtypes numpy lacks (bfloat16, the float8s) take
that older path.

A tensor whose elements fill the storage span they cover (contiguous, transposed,
permuted, expanded) keeps its strides and is sent with the bytes it spans (or its
storage, see below: at most twice those bytes); a sparse view
(``t[:, 0]`` of a big matrix) is made contiguous first, so no unused bytes travel.

Storage sharing within one message is kept: a dense tensor that covers at least half of
its storage travels with the bytes of that storage, and those bytes travel once per
message (``_storage_bytes``), so every tensor (and storage) built on them arrives built on
the same memory again (``x`` and ``x.t()`` stay aliased, as with torchdata). A smaller
view (``x[0]`` of a big ``x``) still travels as its own bytes, so that sending a slice
never sends the whole storage; it then arrives as a copy, not aliased.

Anything unusual (another device, autograd, quantized, conjugate / negative bits,
sparse layouts, subclasses) falls back to torch's pickling, which knows how.

A message of one such tensor (a collated batch, sent alone since it is large) pickles to
a stream that depends on its dtype and shape only, its bytes travelling out of band:
``batch_stream_key`` names it so, and a channel pickles it once per name
(``register_stream_key``).

Importing this module registers the reducers (tensors, storages) and the name;
``mprs_plus.runtime`` imports it, so every process of the service has it, whatever its
start method.
"""

from __future__ import annotations

import pickle
import warnings
from typing import Any

import numpy
import torch

from ..transport import register_reducer, register_stream_key
from ..transport.serialize import INLINE_LIMIT, message_memo


def _numpy_dtype(name: str) -> Any:
    """The numpy dtype of torch's dtype ``name`` where numpy shares it with torch (not
    bfloat16, the float8s, ...), else None: those tensors are rebuilt as numpy arrays over
    the buffer, wrapped by ``torch.from_numpy``. Found by trying the dtype, once per process
    and dtype, when a tensor of it first passes: trying every dtype of torch at once cost
    the first batch 9 ms, and import time is on the path to every loader's first item."""
    found = _NUMPY.get(name, _UNKNOWN)
    if found is not _UNKNOWN:
        return found
    found = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # making a tensor of some dtypes warns (complex32, quantized)
        dtype = getattr(torch, name, None)
        try:
            if isinstance(dtype, torch.dtype):
                array = torch.empty((1,), dtype=dtype).numpy()
                if torch.from_numpy(array).dtype == dtype:
                    found = array.dtype
        except (TypeError, RuntimeError):
            pass
    _NUMPY[name] = found
    return found


_UNKNOWN = object()
_NUMPY: dict[str, Any] = {}


def reduce_tensor(tensor: torch.Tensor) -> str | tuple[Any, ...]:
    if (
        not tensor.is_cpu  # not device.type: a device object per tensor, 5x the cost
        or tensor.layout is not torch.strided
        or tensor.is_nested  # strided-layout nested tensors have no single shape or storage
        or tensor.requires_grad
        or tensor.is_quantized
        or tensor.is_conj()
        or tensor.is_neg()
    ):
        return tensor.__reduce_ex__(5)
    dtype = _dtype_name(tensor.dtype)
    shape = tuple(tensor.shape)
    numel = tensor.numel()
    if numel == 0:
        return _rebuild_empty, (dtype, shape)
    strides: tuple[int, ...] | None = tensor.stride()
    contiguous = tensor.is_contiguous()
    span = numel if contiguous else 1 + sum((size - 1) * stride for size, stride in zip(shape, strides))
    itemsize = tensor.element_size()
    if span <= numel:
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if 2 * span * itemsize >= nbytes:
            offset = tensor.storage_offset()
            if _numpy_dtype(dtype) is not None and nbytes % itemsize == 0:
                whole = None
                if offset == 0 and span * itemsize == nbytes and contiguous:
                    strides = None
                    whole = tensor  # its bytes are its storage's
                return _rebuild_on_bytes, (_storage_bytes(storage, whole), dtype, shape, strides, offset)
            return _rebuild_on_storage, (storage, dtype, shape, strides, offset)
        # Dense (or overlapping, as when expanded): the bytes it covers are all useful.
        flat = tensor.as_strided((span,), (1,), tensor.storage_offset())
        if contiguous:
            strides = None
    else:
        flat = tensor.contiguous().view(-1)
        strides = None
    raw = pickle.PickleBuffer(flat.view(torch.uint8).numpy())  # a view: no copy until the channel's
    if _numpy_dtype(dtype) is not None:
        return _rebuild_on_bytes, ((raw,), dtype, shape, strides, 0)
    return _rebuild_tensor, (raw, dtype, shape, strides)


def _dtype_name(dtype: torch.dtype) -> str:
    """``dtype``'s name in ``torch`` ("float32"), looked up once per dtype."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _storage_bytes(storage: torch.UntypedStorage, whole: torch.Tensor | None = None) -> tuple[pickle.PickleBuffer]:
    """The bytes of ``storage`` as one out-of-band buffer, held in a tuple that is the same
    object for every tensor and storage of this message that uses it: pickle memoizes the
    tuple (never a buffer), so the bytes travel once and arrive as one buffer. ``whole``: a
    contiguous tensor that covers the storage exactly (a collated batch, as a rule), whose
    own numpy view is its bytes: about a quarter of the cost of a new tensor set onto the
    storage, which took a fifth of a worker's time on batches of 64 ints."""
    memo = message_memo()
    entry = memo.get(id(storage))  # the memo keeps the storage alive: its id stays its own
    if entry is None:
        if whole is not None:
            raw = whole.numpy()  # a view: no copy; a PickleBuffer's raw() is its bytes
        else:
            raw = torch.empty((0,), dtype=torch.uint8).set_(storage).numpy()  # a view: no copy
        entry = memo[id(storage)] = (storage, (pickle.PickleBuffer(raw),))
    return entry[1]


def _rebuild_on_bytes(
    held: tuple[Any], dtype: str, shape: tuple[int, ...], strides: tuple[int, ...] | None, offset: int
) -> torch.Tensor:
    """A tensor over ``held[0]`` (bytes of a storage, lent shared memory or a copy): one numpy
    array and one ``from_numpy`` for the usual tensor that fills its buffer. Each torch
    call here is a trip through its dispatcher, dear to the main process when its caches
    are cold, as they are between items; this is the whole rebuild."""
    buffer, np_dtype = held[0], _numpy_dtype(dtype)
    if strides is None:
        return torch.from_numpy(numpy.ndarray(shape, np_dtype, buffer))
    whole = torch.from_numpy(numpy.ndarray((len(buffer) // np_dtype.itemsize,), np_dtype, buffer))
    return whole.as_strided(shape, strides, offset)


def _rebuild_tensor(buffer: Any, dtype: str, shape: tuple[int, ...], strides: tuple[int, ...] | None) -> torch.Tensor:
    flat = torch.frombuffer(buffer, dtype=torch.uint8).view(getattr(torch, dtype))
    if strides is None:
        return flat.view(shape)
    return flat.as_strided(shape, strides)


def _rebuild_empty(dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(shape, dtype=getattr(torch, dtype))


def _rebuild_on_storage(
    storage: torch.UntypedStorage, dtype: str, shape: tuple[int, ...], strides: tuple[int, ...], offset: int
) -> torch.Tensor:
    return torch.empty((0,), dtype=getattr(torch, dtype)).set_(storage, offset, shape, strides)


def reduce_storage(storage: torch.UntypedStorage) -> str | tuple[Any, ...]:
    """A CPU storage as one buffer of its bytes (sent once per message, see above)."""
    if storage.device.type != "cpu":
        return storage.__reduce_ex__(5)
    if storage.nbytes() == 0:
        return torch.UntypedStorage, (0,)
    return _rebuild_storage, (_storage_bytes(storage),)


def _rebuild_storage(held: tuple[Any]) -> torch.UntypedStorage:
    return torch.frombuffer(held[0], dtype=torch.uint8).untyped_storage()


register_reducer(torch.Tensor, reduce_tensor)
register_reducer(torch.UntypedStorage, reduce_storage)


def batch_stream_key(message: Any) -> tuple[Any, list[memoryview]] | None:
    """The name of a data message ``(kind, epoch, [tensor])`` whose tensor
    ``reduce_tensor`` sends as the bytes of its whole storage, out of band: plain, CPU,
    contiguous from the storage's start to its end, of a dtype numpy shares, of
    ``INLINE_LIMIT`` bytes or more. Every such message of one kind, epoch, dtype and shape
    pickles to one stream; the tensor's bytes are its one buffer. Anything else: None
    (pickled as usual)."""
    if type(message) is not tuple or len(message) != 3:
        return None
    kind, epoch, items = message
    if type(kind) is not int or type(epoch) is not int or type(items) is not list or len(items) != 1:
        return None
    tensor = items[0]
    if (
        type(tensor) is not torch.Tensor
        or not tensor.is_cpu
        or tensor.layout is not torch.strided
        or tensor.is_nested
        or tensor.requires_grad
        or tensor.is_quantized
        or tensor.is_conj()
        or tensor.is_neg()
        or not tensor.is_contiguous()
        or tensor.storage_offset()
    ):
        return None
    nbytes = tensor.nbytes
    if nbytes < INLINE_LIMIT or nbytes != tensor.untyped_storage().nbytes():
        return None
    dtype = _dtype_name(tensor.dtype)
    if _numpy_dtype(dtype) is None:
        return None
    view = pickle.PickleBuffer(tensor.numpy()).raw()  # what _storage_bytes hands pickling
    return (kind, epoch, dtype, tuple(tensor.shape), view.readonly), [view]


register_stream_key(batch_stream_key)
