"""A worker's global generators as its epoch began, kept where the main process can read
them after the worker died: what a replacement loads to draw what the dead one drew.

    worker, each Reset      reset function (seeding, worker_init_fn on a first epoch)
                            --> capture() --> GeneratorRecord.write(epoch, states)
    main, after the death   GeneratorRecord.read() --> (epoch, states) of the last epoch begun
    replacement, its Reset  reset function, then load(states): the generators as the dead
                            worker had them when that epoch began

Why it is needed: a process seeds ``random``, ``torch`` and numpy once (torch's loader) or
every epoch (torchdata's reseeding), and persistent workers carry their generators from one
epoch into the next. A replacement started in a later epoch is seeded as a new process
would be; loading the recorded states makes it the worker that began this epoch, and the
replay of the items the loop already has then draws exactly what the dead worker drew.

The record is written once per epoch, never per item: no cost on the path of an item. Two
slots are written in turn, each stamped with a sequence number stored after its bytes, so
a worker killed in the middle of a write leaves the other slot readable.
"""

from __future__ import annotations

import pickle
import random
import struct
import sys
from typing import Any

import torch

SLOT_BYTES = 60 << 10  # random (~2.5 KiB), torch (~5 KiB) and numpy (~2.5 KiB) pickled: ample room
_HEAD = struct.Struct("<QQQ")  # sequence number, epoch, length of the pickled states


def capture() -> bytes:
    """This process's global generators, pickled: ``random``, ``torch`` and numpy's when it
    is loaded (nothing can have drawn from it otherwise)."""
    numpy_random = sys.modules.get("numpy.random")
    numpy_state = numpy_random.get_state() if numpy_random is not None else None
    return pickle.dumps((random.getstate(), torch.get_rng_state(), numpy_state), protocol=5)


def load(states: bytes) -> None:
    """Set this process's global generators to ``states`` (from ``capture``)."""
    python_state, torch_state, numpy_state = pickle.loads(states)
    random.setstate(python_state)
    torch.set_rng_state(torch_state)
    if numpy_state is not None:
        import numpy.random

        numpy.random.set_state(numpy_state)


class GeneratorRecord:
    """One worker's two slots of shared memory, made by the main process before the worker
    starts (a replacement writes the same slots)."""

    def __init__(self, ctx: Any) -> None:
        self._memory = ctx.RawArray("B", 2 * SLOT_BYTES)

    def __getstate__(self) -> Any:
        return self._memory

    def __setstate__(self, memory: Any) -> None:
        self._memory = memory

    def write(self, epoch: int, states: bytes) -> None:
        if len(states) + _HEAD.size > SLOT_BYTES:
            return  # cannot happen with the three generators; a replacement is then seeded anew
        # Numbered on from the slots themselves: a replacement writes after its predecessor.
        sequence = max(self._stamps()) + 1
        start = (sequence % 2) * SLOT_BYTES
        view = memoryview(self._memory).cast("B")
        view[start : start + _HEAD.size] = bytes(_HEAD.size)  # unreadable until its bytes are whole
        view[start + _HEAD.size : start + _HEAD.size + len(states)] = states
        view[start : start + _HEAD.size] = _HEAD.pack(sequence, epoch, len(states))

    def read(self) -> tuple[int, bytes] | None:
        """(epoch, states) of the latest complete write, or None before the first."""
        view = memoryview(self._memory).cast("B")
        best = None
        for slot in (0, 1):
            sequence, epoch, length = _HEAD.unpack_from(view, slot * SLOT_BYTES)
            if sequence and (best is None or sequence > best[0]):
                start = slot * SLOT_BYTES + _HEAD.size
                best = (sequence, epoch, bytes(view[start : start + length]))
        return None if best is None else (best[1], best[2])

    def sequence(self) -> int:
        """How many records were written: one more once a (replacement) worker began its epoch."""
        return max(self._stamps())

    def _stamps(self) -> list[int]:
        view = memoryview(self._memory).cast("B")
        return [_HEAD.unpack_from(view, slot * SLOT_BYTES)[0] for slot in (0, 1)]
