"""A worker's global generators, recorded where the main process can read them after the
worker died: what a replacement loads to draw what the dead one drew, and where it can
start without making the items before.

    worker, each Reset      reset function (seeding, worker_init_fn on a first epoch)
                            --> GeneratorRecord.write(epoch, 0, capture())    the epoch's start
    worker, while it makes  note(position) by the stream, after each item: at most every
    items                   RECORD_SECONDS --> write(epoch, position, capture())
    main, after the death   read(epoch, at_most=items received) --> the latest record at or
                            before what the loop has: (position, states)
    replacement, its Reset  reset function, then load(states); a stream that can start at a
                            position without making the items before it (``jump_to``, a
                            map-style ``mprs_plus.DataLoader``) replays only from there

Why it is needed: a process seeds ``random``, ``torch`` and numpy once (torch's loader) or
every epoch (torchdata's reseeding), and persistent workers carry their generators from one
epoch into the next. A replacement started in a later epoch is seeded as a new process
would be; loading the recorded states makes it the worker that began this epoch (or that
had made ``position`` items of it), and the replay of the items after that draws exactly
what the dead worker drew.

Only a stream that calls ``note`` records mid-epoch: one whose items depend on nothing but
their position and the generators (``LoaderStage`` of a map-style dataset without
``state_dict()``). The cost is one clock read per item, and a capture (about 20 µs) every
``RECORD_SECONDS``: nothing on the path of an item of any other stream.

Where the records go. A worker of this host writes them into shared memory
(``GeneratorRecord``), which outlives it. A Ray actor, maybe on another node, has no memory
the training process can read after its death: it sends each record on its data channel
as a message of its own (``SentRecord``, a RECORD beside the items, at the same moments:
nothing more per item), and the main process keeps the latest ones of each worker
(``ReceivedRecords``) as it reads the channel, with the dead one's last messages drained.

Slot 0 holds the epoch's start; slots 1..``RING`` the latest mid-epoch records in turn. A
record newer than what the loop received (items made, not yet sent: at most one message)
cannot be used, so several are kept. Each slot is stamped with a sequence number stored
after its bytes, its old stamp cleared first: a worker killed mid-write leaves the slot
unreadable, never torn.
"""

from __future__ import annotations

import pickle
import random
import struct
import sys
import time
from collections import deque
from typing import Any

import torch

SLOT_BYTES = 24 << 10  # random (~2.5 KiB), torch (~5 KiB) and numpy (~2.5 KiB) pickled: ample room
RING = 8  # mid-epoch slots
RECORD_SECONDS = 0.1  # at most one mid-epoch record this often
_HEAD = struct.Struct("<QQQQ")  # sequence number, epoch, position, length of the pickled states


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
    """One worker's slots of shared memory, made by the main process before the worker
    starts (a replacement writes the same slots)."""

    def __init__(self, ctx: Any) -> None:
        self._memory = ctx.RawArray("B", (1 + RING) * SLOT_BYTES)
        self._turn = 0  # the writer's next mid-epoch slot

    def __getstate__(self) -> Any:
        return self._memory

    def __setstate__(self, memory: Any) -> None:
        self._memory = memory
        self._turn = 0

    def write(self, epoch: int, position: int, states: bytes) -> None:
        if len(states) + _HEAD.size > SLOT_BYTES:
            return  # cannot happen with the three generators; a replacement then replays more
        if position == 0:
            slot = 0
        else:
            slot = 1 + self._turn % RING
            self._turn += 1
        # Numbered on from the slots themselves: a replacement writes after its predecessor.
        sequence = self.sequence() + 1
        start = slot * SLOT_BYTES
        view = memoryview(self._memory).cast("B")
        view[start : start + _HEAD.size] = bytes(_HEAD.size)  # unreadable until its bytes are whole
        view[start + _HEAD.size : start + _HEAD.size + len(states)] = states
        view[start : start + _HEAD.size] = _HEAD.pack(sequence, epoch, position, len(states))

    def read(self, epoch: int, at_most: int) -> tuple[int, bytes] | None:
        """(position, states) of the latest complete record of ``epoch`` at a position no
        later than ``at_most``, or None."""
        view = memoryview(self._memory).cast("B")
        best = None
        for slot in range(1 + RING):
            sequence, recorded, position, length = _HEAD.unpack_from(view, slot * SLOT_BYTES)
            if not sequence or recorded != epoch or position > at_most:
                continue
            if best is None or (position, sequence) > best[:2]:
                start = slot * SLOT_BYTES + _HEAD.size
                best = (position, sequence, bytes(view[start : start + length]))
        return None if best is None else (best[0], best[2])

    def sequence(self) -> int:
        """How many records were written: more once a (replacement) worker began its epoch."""
        view = memoryview(self._memory).cast("B")
        return max(_HEAD.unpack_from(view, slot * SLOT_BYTES)[0] for slot in range(1 + RING))


class SentRecord:
    """A worker's records sent to the main process on its data channel (a Ray actor's):
    each one a RECORD message of the lane that records, the items it made before it sent
    first, so that it arrives after them. The main side keeps them (``ReceivedRecords``)."""

    def write(self, epoch: int, position: int, states: bytes) -> None:
        from .child.lanes import send_aside_current_lane

        del epoch  # the lane stamps its own: the epoch being made
        try:
            send_aside_current_lane((position, states))
        except Exception:  # the channel is gone (the service stops): the lane's next send says so
            pass


class ReceivedRecords:
    """The main process's copy of one worker's records (``SentRecord``): the epoch's start
    and the latest ``RING`` mid-epoch ones of the epoch it is in, read as
    ``GeneratorRecord`` is read. Written and read by the reading thread only."""

    def __init__(self) -> None:
        self._epoch = -1
        self._records: deque[tuple[int, int, bytes]] = deque(maxlen=RING)  # (position, sequence, states)
        self._start: tuple[int, int, bytes] | None = None
        self._sequence = 0

    def add(self, epoch: int, record: Any) -> None:
        position, states = record
        if epoch != self._epoch:
            self._epoch, self._start = epoch, None
            self._records.clear()
        self._sequence += 1
        entry = (position, self._sequence, states)
        if position == 0:
            self._start = entry
        else:
            self._records.append(entry)

    def read(self, epoch: int, at_most: int) -> tuple[int, bytes] | None:
        if epoch != self._epoch:
            return None
        found = [entry for entry in (self._start, *self._records) if entry is not None and entry[0] <= at_most]
        if not found:
            return None
        position, _, states = max(found, key=lambda entry: entry[:2])
        return position, states

    def sequence(self) -> int:
        return self._sequence


class _Recording:
    """This process's record and epoch while a stream may note positions (set by the
    child's control as each epoch begins), and where a replacement starts."""

    record: GeneratorRecord | None = None
    epoch = 0
    next_at = 0.0
    jump = 0  # a replacement: the position its loaded states were recorded at


_recording = _Recording()


def begin_epoch(record: GeneratorRecord | None, epoch: int, jump: int = 0) -> None:
    """Called by the child's control once the epoch's reset ran (and a replacement loaded
    its states): the epoch's start is recorded, and mid-epoch notes go to ``record``."""
    _recording.record, _recording.epoch, _recording.jump = record, epoch, jump
    _recording.next_at = time.monotonic() + RECORD_SECONDS
    if record is not None:
        # A replacement's start is the position its states were recorded at, not 0.
        record.write(epoch, jump, capture())


def note(position: int) -> None:
    """A stream made its items before ``position`` (and drew nothing since): record the
    generators now if the last record is ``RECORD_SECONDS`` old. A no-op without a record."""
    recording = _recording
    if recording.record is None or time.monotonic() < recording.next_at:
        return
    recording.next_at = time.monotonic() + RECORD_SECONDS
    recording.record.write(recording.epoch, position, capture())


def jump_to() -> int:
    """Where a replacement's stream may start without making the items before it: the
    position its loaded states were recorded at (0: the epoch's start). Read once."""
    jump, _recording.jump = _recording.jump, 0
    return jump
