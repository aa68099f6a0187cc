"""A worker's global generators, and its dataset's state where it has one, recorded where
the main process can read them after the worker died: what a replacement loads to draw
what the dead one drew, and where it can start without making the items before.

    worker, each Reset      reset function (seeding, worker_init_fn on a first epoch)
                            --> GeneratorRecord.write(epoch, 0, generators)  the epoch's start
    worker, while it makes  note(position[, state]) by the stream, after each item: at most
    items                   every RECORD_SECONDS --> write(epoch, position, generators and
                            the dataset's state)
    main, after the death   read(epoch, at_most=items received) --> the latest record at or
                            before what the loop has: (position, record)
    replacement, its Reset  prepare(record) before the reset function, which loads the
                            dataset's state (``dataset_restore``); begin_epoch loads the
                            generators after it; the stream starts at the record's position
                            (``jump_to``, ``LoaderStage.resume_from``) and makes again only
                            the items after it

Why it is needed: a process seeds ``random``, ``torch`` and numpy once (torch's loader) or
every epoch (torchdata's reseeding), and persistent workers carry their generators from one
epoch into the next. A replacement started in a later epoch is seeded as a new process
would be; loading the recorded states makes it the worker that began this epoch (or that
had made ``position`` items of it), and the replay of the items after that draws exactly
what the dead worker drew.

Only a stream that calls ``note`` records mid-epoch, one whose items depend on nothing but
their position, the generators and the dataset's own state (``LoaderStage``: a map-style
dataset, with or without ``state_dict()``, and an iterable dataset with one). The cost is
one clock read per item, and every ``RECORD_SECONDS`` a capture (about 20 µs, plus the
dataset's ``state_dict()``): nothing on the path of an item of any other stream.

A record is bounded (``SLOT_BYTES``): a dataset whose state does not fit, or whose
``state_dict()`` raises, is not recorded again in that epoch, and a replacement goes on
from the latest record that fit, or from the epoch's start.

Where the records go. A worker of this host writes them into shared memory
(``GeneratorRecord``), which outlives it. A Ray actor, maybe on another node, has no memory
the training process can read after its death: it sends each record on its data channel
as a message of its own (``SentRecord``, a RECORD beside the items, at the same moments:
nothing more per item), and the main process keeps the latest ones of each worker
(``ReceivedRecords``) as it reads the channel, with the dead one's last messages drained.
Every actor sends one as its stream begins (a replacement from a later record sends that
one again): an actor that sent none died before, in its reset or ``worker_init_fn``, and
its death names no item (``main/replacement.py``, the poison rule).

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
from collections.abc import Callable
from collections import deque
from typing import Any

import torch

# The three generators pickled take about 9 KiB (random ~2.5, torch ~5, numpy ~2.5): a
# dataset's state may take the rest.
SLOT_BYTES = 64 << 10
RING = 8  # mid-epoch slots
RECORD_SECONDS = 0.1  # at most one mid-epoch record this often
_HEAD = struct.Struct("<QQQQ")  # sequence number, epoch, position, length of the pickled record
_NO_STATE = ()  # a record without a dataset state (pickled as the record's second part)


def capture() -> tuple[Any, Any, Any]:
    """This process's global generators: ``random``, ``torch`` and numpy's when it is
    loaded (nothing can have drawn from it otherwise)."""
    numpy_random = sys.modules.get("numpy.random")
    numpy_state = numpy_random.get_state() if numpy_random is not None else None
    return (random.getstate(), torch.get_rng_state(), numpy_state)


def load(states: tuple[Any, Any, Any]) -> None:
    """Set this process's global generators to ``states`` (from ``capture``)."""
    python_state, torch_state, numpy_state = states
    random.setstate(python_state)
    torch.set_rng_state(torch_state)
    if numpy_state is not None:
        import numpy.random

        numpy.random.set_state(numpy_state)


def _pickled(dataset_state: Any = _NO_STATE) -> bytes:
    """A record: the generators now, and the dataset's state (a one-item tuple) or none."""
    return pickle.dumps((capture(), dataset_state), protocol=5)


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

    def write(self, epoch: int, position: int, states: bytes) -> bool:
        """Record ``states`` (from ``_pickled``); False, and nothing written, if they do not fit."""
        if len(states) + _HEAD.size > SLOT_BYTES:
            return False  # a dataset's state too large: a replacement replays more
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
        return True

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

    def resumed(self, epoch: int, position: int, states: bytes) -> None:
        """A replacement began its stream from the record at ``position``: its slot holds it
        already, and which item a worker makes is read from its liveness slots."""

    def sequence(self) -> int:
        """How many records were written: more once a (replacement) worker began its epoch."""
        view = memoryview(self._memory).cast("B")
        return max(_HEAD.unpack_from(view, slot * SLOT_BYTES)[0] for slot in range(1 + RING))


class SentRecord:
    """A worker's records sent to the main process on its data channel (a Ray actor's):
    each one a RECORD message of the lane that records, the items it made before it sent
    first, so that it arrives after them. The main side keeps them (``ReceivedRecords``)."""

    def write(self, epoch: int, position: int, states: bytes) -> bool:
        """As ``GeneratorRecord.write``: False, and nothing sent, for a record over a slot's size."""
        from .child.lanes import send_aside_current_lane

        del epoch  # the lane stamps its own: the epoch being made
        if len(states) + _HEAD.size > SLOT_BYTES:
            return False
        try:
            send_aside_current_lane((position, states))
        except Exception:  # the channel is gone (the service stops): the lane's next send says so
            pass
        return True

    def resumed(self, epoch: int, position: int, states: bytes) -> None:
        """A replacement began its stream from the record at ``position``: it sends that
        record again, which tells the main process that it got past its reset
        (``ReceivedRecords.began``), as the epoch's start record does for any other."""
        self.write(epoch, position, states)


class ReceivedRecords:
    """The main process's copy of one worker's records (``SentRecord``): the epoch's start
    and the latest ``RING`` mid-epoch ones of the epoch it is in, read as
    ``GeneratorRecord`` is read. Written and read by the reading thread only.

    A record also says that the actor that sent it got past its epoch's reset (its
    ``worker_init_fn`` included): every actor sends one as its stream begins. An actor that
    died before has begun no item (``began``)."""

    def __init__(self) -> None:
        self._epoch = -1
        self._records: deque[tuple[int, int, bytes]] = deque(maxlen=RING)  # (position, sequence, states)
        self._start: tuple[int, int, bytes] | None = None
        self._sequence = 0
        self._began = -1  # the epoch in which the current actor sent a record, -1: none yet

    def began(self, epoch: int) -> bool:
        """Whether the current actor began its stream of ``epoch`` (it sent a record)."""
        return self._began == epoch

    def new_actor(self) -> None:
        """A replacement takes the worker's place: it has begun nothing yet."""
        self._began = -1

    def add(self, epoch: int, record: Any) -> None:
        position, states = record
        self._began = epoch
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


class _Recording:
    """This process's record and epoch while a stream may note positions (set by the
    child's control as each epoch begins), and where a replacement starts."""

    record: GeneratorRecord | None = None
    epoch = 0
    next_at = 0.0
    stopped = False  # the dataset's state did not fit, or raised: no more records this epoch
    jump = 0  # a replacement: the position its loaded states were recorded at
    pending: tuple[int, tuple[Any, Any, Any], bytes] | None = None  # a replacement's record, until loaded
    dataset: tuple[int, Any] | None = None  # its dataset's state, until the stream takes it


_recording = _Recording()


def prepare(restore: bytes) -> None:
    """Called by the child's control as a Reset arrives, before the reset function runs:
    ``restore`` is a replacement's record (``pack((position, record))``), or empty. The
    dataset's state in it waits for the stream (``dataset_restore``), the generators for
    ``begin_epoch``."""
    _recording.pending = _recording.dataset = None
    if not restore:
        return
    position, record = pickle.loads(restore)
    states, dataset = pickle.loads(record)
    _recording.pending = (position, states, record)
    if dataset:  # (state,), or _NO_STATE
        _recording.dataset = (position, dataset[0])


def dataset_restore() -> tuple[int, Any] | None:
    """For a stream whose dataset has a state, in its reset: (position, the dataset's state
    after that many items) recorded with the generators the replacement loads; else None.
    Read once."""
    found, _recording.dataset = _recording.dataset, None
    return found


def begin_epoch(record: GeneratorRecord | None, epoch: int) -> None:
    """Called by the child's control once the epoch's reset ran: a replacement loads its
    predecessor's generators (``prepare``); the epoch's start is recorded, and mid-epoch
    notes go to ``record``."""
    pending, _recording.pending = _recording.pending, None
    _recording.dataset = None  # a stream that did not take it has no state to load
    jump, raw = 0, b""
    if pending is not None:
        jump, states, raw = pending
        load(states)
    _recording.record, _recording.epoch, _recording.jump = record, epoch, jump
    _recording.stopped = False
    _recording.next_at = time.monotonic() + RECORD_SECONDS
    if record is None:
        return
    if jump == 0:
        record.write(epoch, 0, _pickled())
    else:  # a replacement from a later record: slot 0 keeps the start
        record.resumed(epoch, jump, raw)


def note(position: int, state: Callable[[], Any] | None = None) -> None:
    """A stream made its items before ``position`` (and drew nothing since): record the
    generators now if the last record is ``RECORD_SECONDS`` old, with ``state()``, the
    dataset's state as it is now, for a stream whose items depend on it. A no-op without
    a record."""
    recording = _recording
    if recording.record is None or recording.stopped or time.monotonic() < recording.next_at:
        return
    recording.next_at = time.monotonic() + RECORD_SECONDS
    if state is None:
        recording.record.write(recording.epoch, position, _pickled())
        return
    try:
        record = _pickled((state(),))
    except Exception:  # user code (state_dict(), its pickling): not recorded again this epoch
        recording.stopped = True
        return
    if not recording.record.write(recording.epoch, position, record):
        recording.stopped = True  # too large: each try would cost a state_dict() and a pickling for nothing


def jump_to() -> int:
    """Where a replacement's stream may start without making the items before it: the
    position its loaded states were recorded at (0: the epoch's start). Read once."""
    jump, _recording.jump = _recording.jump, 0
    return jump
