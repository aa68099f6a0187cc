"""Pickle protocol 5 with large buffers out of band, and a registry of fast reducers.

    obj --Encoder.encode--> pickle stream (small) + [large buffers, zero-copy views]
                            the channel copies each buffer straight into shared memory
                            (none that was built there: ``Sender.borrow``)
    pickle.loads(stream, buffers=[...]) --> obj

Buffers of ``INLINE_LIMIT`` bytes or more go out of band; smaller ones stay in the
stream, where they are cheaper. An out-of-band buffer arrives as a writable
``bytearray`` (copied out of the ring) or, when the shared-memory transport lent it
(``_lend.py``), as a uint8 numpy array over shared memory: no copy at all. Reducers
rebuild from either through the buffer protocol.

``register_reducer(cls, fn)`` adds a reducer for instances of exactly ``cls`` (as
``copyreg`` does, but only for this transport's picklers, never process-wide).
``register_stream_key(fn)`` names messages whose pickle stream depends on a few facts
only (a batch of one large tensor: its dtype and shape, its bytes travel out of band):
an encoder pickles the first message of each name and sends the next ones with the
same stream, their buffers beside it, without pickling them. The
transport itself knows no array library: numpy's reducer below is registered lazily once
numpy is imported, and the runtime registers one for torch tensors. Both exist because
the defaults are slow: numpy pickles every array's dtype the long way, torch copies a
tensor's storage into the stream (figures in docs/benchmarks-history.md, Design figures).
"""

from __future__ import annotations

import copyreg
import io
import pickle
import sys
import threading
from collections.abc import Callable
from typing import Any

INLINE_LIMIT = 4096
# A stream up to this size is returned as bytes (a copy, but cheaper than a view of the
# pickler's buffer, which must be released); a longer one as a view.
_COPY_STREAM_LIMIT = 1 << 16

Reducer = Callable[[Any], "str | tuple[Any, ...]"]

_reducers: dict[type, Reducer] = {}
_stream_key: Callable[[Any], "tuple[Any, list[memoryview]] | None"] | None = None
_registry_version = 0
# Streams an encoder keeps by name (``register_stream_key``); when full, it starts over.
_STREAMS_KEPT = 32
_numpy_registered = False
_message = threading.local()


def message_memo() -> dict[Any, Any]:
    """A dict that lives while this thread's ``Encoder`` pickles one message, then is
    dropped: where a reducer keeps what must be sent once per message whatever object
    refers to it (pickle's own memo dedupes objects, not, say, the bytes of a storage that
    two tensors reduce to). Outside an ``encode`` a fresh dict each call: nothing shared."""
    memo = getattr(_message, "memo", None)
    return {} if memo is None else memo


def register_reducer(cls: type, reducer: Reducer) -> None:
    """Pickle instances of exactly ``cls`` with ``reducer`` (a ``__reduce__``-style function)
    in every channel of this process. Subclasses keep their own pickling."""
    global _registry_version
    _reducers[cls] = reducer
    _registry_version += 1


def register_stream_key(key_of: Callable[[Any], "tuple[Any, list[memoryview]] | None"] | None) -> None:
    """Messages whose pickle stream ``key_of`` names, in every channel of this process:
    ``key_of(obj)`` returns ``(name, views)`` or None. Its promise: every message with
    that name pickles (with the reducers registered now) to the same stream, and
    ``views`` are the message's out-of-band buffers, in order, as byte views. Pickling a
    batch of one tensor (128 x 256 floats) cost a worker 16 to 22 us; naming it and
    looking its stream up, 7 to 10. ``key_of`` must be cheap and refuse (None) whatever
    it is not sure of; should it raise, the message is pickled. None stops it."""
    global _stream_key, _registry_version
    _stream_key = key_of
    _registry_version += 1


def _dispatch_table() -> dict[type, Reducer]:
    if not _numpy_registered and "numpy" in sys.modules:
        _register_numpy()
    # An exact dict: the C pickler looks it up without calling back into Python.
    return {**copyreg.dispatch_table, **_reducers}


class Encoder:
    """Pickles messages for one sending endpoint, reusing one pickler (about half the cost
    of ``pickle.dumps`` for a small message). Not thread-safe, like the endpoint."""

    def __init__(self) -> None:
        self._file = io.BytesIO()
        self._buffers: list[pickle.PickleBuffer] = []
        self._pickler: pickle.Pickler | None = None
        self._version = -1
        self._copyreg_size = -1
        self._stream: memoryview | None = None
        self._views: list[memoryview] = []
        self._streams: dict[Any, bytes] = {}  # by the name register_stream_key gave them

    def encode(self, obj: Any) -> tuple[bytes | memoryview, list[memoryview]]:
        """The pickle stream and the out-of-band buffers (byte views) of ``obj``. Both stay
        valid until ``release()`` or the next ``encode``."""
        if self._stream is not None or self._views or self._buffers:
            self.release()
        pickler = self._pickler
        # Checked on every message, and cheap: a reducer registered later (by us, or in
        # copyreg by a library imported late) must not be missed by a cached pickler.
        if (
            pickler is None
            or self._version != _registry_version
            or self._copyreg_size != len(copyreg.dispatch_table)
            or (not _numpy_registered and "numpy" in sys.modules)
        ):
            pickler = self._new_pickler()
        named = None
        if _stream_key is not None:
            try:
                named = _stream_key(obj)
            except Exception:  # a name it could not make: pickling says what it makes of obj
                named = None
        if named is not None:
            stream = self._streams.get(named[0])
            if stream is not None:
                self._views = named[1]
                return stream, self._views
        file = self._file
        file.seek(0)
        file.truncate()
        outer, _message.memo = getattr(_message, "memo", None), {}
        try:
            pickler.dump(obj)
        except BaseException:
            self._pickler = None  # start the next message from a fresh pickler
            self._buffers.clear()  # buffers of the failed message
            raise
        finally:
            pickler.clear_memo()  # the memo holds references to parts of obj
            _message.memo = outer  # and so does the reducers'
        if file.tell() <= _COPY_STREAM_LIMIT:
            stream: bytes | memoryview = file.getvalue()
        else:
            stream = self._stream = file.getbuffer()
        if self._buffers:
            self._views = [buffer.raw() for buffer in self._buffers]
        if named is not None:
            self._keep(named, stream)
        return stream, self._views

    def _keep(self, named: tuple[Any, list[memoryview]], stream: bytes | memoryview) -> None:
        """Keep the stream of a named message for the next ones of its name, where what
        pickling gave agrees with the name's promise (as many buffers, as long)."""
        name, views = named
        try:
            if type(stream) is bytes and [v.nbytes for v in views] == [v.nbytes for v in self._views]:
                if len(self._streams) >= _STREAMS_KEPT:
                    self._streams.clear()
                self._streams[name] = stream
        finally:
            for view in views:
                view.release()  # the views pickling made travel instead

    def release(self) -> None:
        """Drop the views of the last message, so its arrays are not kept alive by us."""
        if self._stream is not None:
            self._stream.release()
            self._stream = None
        if self._views:
            for view in self._views:
                view.release()
            self._views = []
        self._buffers.clear()

    def _new_pickler(self) -> pickle.Pickler:
        table = _dispatch_table()
        # The callback holds the buffer list, not the encoder: an encoder -> pickler ->
        # bound method -> encoder cycle would keep a closed channel's mapping alive until a
        # garbage collection.
        pickler = pickle.Pickler(self._file, protocol=5, buffer_callback=_out_of_band_keeper(self._buffers))
        pickler.dispatch_table = table  # type: ignore[misc]
        self._pickler = pickler
        self._streams.clear()  # a reducer changed: the streams may have
        self._version = _registry_version
        self._copyreg_size = len(copyreg.dispatch_table)
        return pickler

def _out_of_band_keeper(buffers: list[pickle.PickleBuffer]) -> Callable[[pickle.PickleBuffer], bool]:
    """Pickle's ``buffer_callback``: a buffer of ``INLINE_LIMIT`` bytes or more travels out
    of band (appended to ``buffers``); a smaller one, or one not contiguous (pickle then
    reports it), stays in the stream: returning True keeps it there, pickle's convention."""

    def keep_out_of_band(buffer: pickle.PickleBuffer) -> bool:
        try:
            with buffer.raw() as raw:
                if raw.nbytes < INLINE_LIMIT:
                    return True
        except BufferError:
            return True
        buffers.append(buffer)
        return False

    return keep_out_of_band


# -- numpy ----------------------------------------------------------------------------


def _register_numpy() -> None:
    global _numpy_registered
    import numpy

    _numpy_registered = True
    register_reducer(numpy.ndarray, _reduce_ndarray)


# dtype -> its string when our reducer can carry it (None when numpy's own must), and
# string -> dtype on the way back: a dtype is looked up once, not parsed per array.
_dtype_strings: dict[Any, str | None] = {}
_dtypes: dict[str, Any] = {}


def _reduce_ndarray(array: Any) -> str | tuple[Any, ...]:
    """An array as (dtype string, shape, order) plus its bytes as one PickleBuffer."""
    dtype = array.dtype
    try:
        dtype_str = _dtype_strings[dtype]
    except KeyError:
        plain = not (dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None or dtype.itemsize == 0)
        dtype_str = _dtype_strings[dtype] = dtype.str if plain else None
    if dtype_str is None:
        return array.__reduce_ex__(5)  # numpy's own way: these need their full dtype
    flags = array.flags
    if flags.c_contiguous:
        order = "C"
    elif flags.f_contiguous:
        order = "F"
    else:
        import numpy

        array = numpy.ascontiguousarray(array)
        order = "C"
    if dtype.kind in "mM":  # datetimes refuse to export a buffer: send their bytes
        import numpy

        return _rebuild_ndarray, (pickle.PickleBuffer(array.ravel(order="K").view(numpy.uint8)), dtype_str, array.shape, order)
    return _rebuild_ndarray, (pickle.PickleBuffer(array), dtype_str, array.shape, order)


def _rebuild_ndarray(buffer: Any, dtype_str: str, shape: tuple[int, ...], order: str) -> Any:
    import numpy

    dtype = _dtypes.get(dtype_str)
    if dtype is None:
        dtype = _dtypes[dtype_str] = numpy.dtype(dtype_str)
    # One constructor, arguments by position: frombuffer + reshape with keywords cost the
    # receiver (a training loop's main process) measurably more per array, even hot.
    return numpy.ndarray(shape, dtype, buffer, 0, None, order)
