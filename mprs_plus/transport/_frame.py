"""One message as bytes: the frame that the pipe and the stream transports both carry.

    [u64 nbuf][nbuf x u64 length][pickle][buffer 0]...[buffer nbuf-1]

pickled by ``serialize.Encoder`` (registered reducers, large buffers out of band, written
after the stream). A transport adds what its medium needs around it (a pipe's message
boundary, a stream's length prefix); the frame itself is the same everywhere.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Sequence
from typing import Any

from .serialize import Encoder

COUNT = struct.Struct("<Q")  # nbuf, and each buffer's length


def encode(encoder: Encoder, obj: Any) -> tuple[bytes, bytes | memoryview, list[memoryview]]:
    """``obj`` as a frame in three parts: the header (``nbuf`` and the lengths), the pickle
    stream and the out-of-band buffers. The parts are views the encoder owns: valid until
    ``encoder.release()``, which the caller calls once they are written."""
    stream, buffers = encoder.encode(obj)
    head = struct.pack(f"<Q{len(buffers)}Q", len(buffers), *(b.nbytes for b in buffers))
    return head, stream, buffers


def lengths(data: memoryview | bytes | bytearray, at: int = 0) -> tuple[int, ...]:
    """The buffer lengths of the frame whose header begins at ``at`` of ``data`` (which
    holds at least the whole header)."""
    (nbuf,) = COUNT.unpack_from(data, at)
    return struct.unpack_from(f"<{nbuf}Q", data, at + COUNT.size)


def decode(data: memoryview) -> Any:
    """The message of one whole frame; its buffers copied into writable memory, as the
    rings give them."""
    sizes = lengths(data)
    stream_end = len(data) - sum(sizes)
    at, buffers = stream_end, []
    for size in sizes:
        buffers.append(bytearray(data[at : at + size]))
        at += size
    return loads(data[COUNT.size * (1 + len(sizes)) : stream_end], buffers)


def loads(stream: Any, buffers: Sequence[Any]) -> Any:
    """The message of a pickle stream and its out-of-band buffers."""
    return pickle.loads(stream, buffers=buffers)
