"""Large buffers handed over without a copy in the receiver: the channel's lend area.

Why
    Copying a buffer out of the ring costs the receiving process a pass over every byte.
    In the main process of a data loader that one core then caps the bandwidth, however
    many workers produce. So a large out-of-band buffer is not put in the ring: the sender
    copies it into the channel's *lend area* (the part of the shared region after the
    ring, see ``_memory.py``) and the frame carries only where it is. The receiver hands
    the user an array that *is* that memory, and the extent goes back to the sender when
    the user drops the last reference to it: one copy in the producer, none in the
    consumer.

::

    sender (LendArea)                         receiver (LentViews)
    reserve: a free extent + a free slot;
             slot state = LENT
    copy the buffer into the extent
    frame: [length | LENT_BIT] [offset, slot] -->  root = uint8 ndarray over the extent
                                                   weakref(root) dies -> slot state = FREE
    reap: slots whose state is FREE give
          their extents back to the free list

Who writes a slot's state word (``SLOT_BASE + slot`` in the control page)
    The sender sets it to LENT only while it is FREE (the slot is its own then); the
    receiver sets it to FREE only once nothing can read the extent any more: the root
    array and everything built on it are gone, the bytes were copied out, or the message
    was skipped unread. The receiver's reads of the extent come before its store of FREE,
    and the sender's check of FREE before its writes: x86-64 never reorders a load with a
    later store, so the two never overlap.

Why the root is an ndarray
    Every view built on the buffer must keep the root alive, whatever the library does
    with it: numpy ``frombuffer``/``view``/``reshape``, ``torch.frombuffer``/``from_numpy``,
    ``memoryview``, pickle's read-only buffers. A memoryview root fails that test (numpy
    and pickle re-export the memory behind it and drop it); an ndarray whose own base is
    not an ndarray passes it, and takes weak references. ``tests/transport`` checks each
    of these paths.

Bounds: memory stays bounded, and no consumer can stall a producer
    * In flight. Lent bytes sent and not yet read count against the ring's size, as the
      ring's own bytes do: the sender waits (the channel's usual wait for room, woken by
      the receiver's reads) while ``sent - read`` of them would pass it. A buffer larger
      than that goes when nothing lent is in flight.
    * Held. A receiver lends at most ``HOLD_FACTOR`` times the ring's size in buffers
      its user still holds (counted from when they are read: a batch of items waiting to
      be yielded counts too), and always at least one buffer; past that it copies the buffer out and gives the
      extent back at once. So ``list(loader)`` keeps copies, not extents, and the sender
      always gets extents back from what is in flight.
    * The area is ``LEND_FACTOR`` times the ring: room for both bounds, and slack for
      fragmentation. If the sender still finds no extent (or no free slot, ``SLOTS``), the
      buffer goes through the ring, copied: the sender never waits for the user.
    * Buffers under ``LEND_MIN`` bytes are copied: for them a copy costs less than the
      bookkeeping.

``lending()`` reports what this process's receivers did; ``stats()`` of the service shows
it for the main process.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

from ._memory import PAGE, SharedRegion
from .traffic import Lending

# Bytes; smaller buffers are copied through the ring. Measured on a 2-core machine (a
# producer re-sending one array): at 64 KiB lending and copying cost the receiver the
# same 6 us per item and copying went faster; at 128 KiB lending saves the receiver a
# sixth of its CPU, and the gap grows with the size.
LEND_MIN = 128 << 10
HOLD_FACTOR = 2  # a receiver lends its user up to this many times the ring at a time
LEND_FACTOR = 4  # the lend area is this many times the ring: in flight, held, and slack
SLOTS = 256  # extents one channel can have lent at a time
SLOT_BASE = 64  # control word of slot 0's state (lines 0-3 are the ring's, _ring.py)
FREE, LENT = 0, 1
LENT_BIT = 1 << 63  # in a buffer's length word: the frame holds [offset, slot], not bytes
DESCRIPTOR = 16  # bytes of [offset, slot] in a frame



class _Holding:
    """Process-wide counters. The lock is held for a few integer operations only, never
    across anything that can run a finalizer, so a release from any thread is safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lent = self.copied = self.held_buffers = self.held_bytes = 0
        # id of the weak reference to a root -> (that reference, its receiver's views,
        # slot, length). Keyed by id: a weak reference hashes as its referent, and arrays
        # do not hash.
        self.roots: dict[int, tuple[weakref.ref[Any], LentViews, int, int]] = {}


_holding = _Holding()


def _forget_inherited() -> None:
    """In a forked child: the parent's lent buffers are the parent's to give back.

    The child has copies of the roots, and if it dropped or collected one, its
    ``_give_back`` would free an extent the parent still reads (and, once the sender
    reused it, free the next buffer lent there too). Dropping the weak references here
    means their callbacks never run in the child. A new lock, too: a fork may have copied
    the old one while another thread held it."""
    global _holding
    _holding = _Holding()


os.register_at_fork(after_in_child=_forget_inherited)


def lending() -> Lending:
    """What this process's receivers lent and copied so far, and what is held now."""
    h = _holding
    with h.lock:
        return Lending(h.lent, h.copied, h.held_buffers, h.held_bytes)


def _give_back(ref: weakref.ref[Any]) -> None:
    """The root of a lent buffer died: its extent is the sender's again."""
    entry = _holding.roots.pop(id(ref), None)
    if entry is None:
        return
    _, views, slot, length = entry
    try:
        views.ctl[SLOT_BASE + slot] = FREE
    except ValueError:
        pass  # the channel was released here: nobody is left to give it back to
    with _holding.lock:
        _holding.held_buffers -= 1
        _holding.held_bytes -= length
        views.held -= length


class LendArea:
    """The sender's side: which extents of the area are free, and which slots lend what.

    Extents are page-aligned. A best-fit free list first, then space never used (a bump
    pointer), then coalescing of neighbours; freed extents are found by reading the state
    words of the lent slots (``reap``), which costs the receiver nothing."""

    def __init__(self, ctl: memoryview, area: memoryview) -> None:
        self._ctl = ctl
        self._area = area
        self._capacity = area.nbytes
        self._top = 0
        self._free: list[tuple[int, int]] = []  # (offset, size)
        self._lent: dict[int, tuple[int, int]] = {}  # slot -> (offset, size)
        self._slots = list(range(SLOTS - 1, -1, -1))
        # An endpoint that lent buffers in another process before it was handed here
        # (the service never does this) does not know which extents are still held:
        # it sends through the ring rather than risk lending one of them again.
        self._inherited = any(ctl[SLOT_BASE + slot] != FREE for slot in range(SLOTS))

    @staticmethod
    def planned(buffers: list[memoryview]) -> int:
        """Bytes of ``buffers`` that are large enough to be lent."""
        return sum(b.nbytes for b in buffers if b.nbytes >= LEND_MIN)

    def reserve(self, buffers: list[memoryview]) -> list[tuple[int, int] | None] | None:
        """An (offset, slot) per buffer that goes through the area, None per buffer that
        goes through the ring; None when none is lent. Reserved slots are LENT from now on:
        ``fill`` them, or ``unreserve`` them if the frame is not sent."""
        if self._inherited:
            return None
        places: list[tuple[int, int] | None] = []
        any_lent = False
        for buffer in buffers:
            place = self._reserve_one(buffer.nbytes) if buffer.nbytes >= LEND_MIN else None
            places.append(place)
            any_lent = any_lent or place is not None
        return places if any_lent else None

    def fill(self, buffers: list[memoryview], places: list[tuple[int, int] | None]) -> int:
        """Copy the lent buffers into their extents; the bytes lent."""
        area, lent = self._area, 0
        for buffer, place in zip(buffers, places):
            if place is not None:
                offset = place[0]
                area[offset : offset + buffer.nbytes] = buffer
                lent += buffer.nbytes
        return lent

    def unreserve(self, places: list[tuple[int, int] | None]) -> None:
        """Take back reservations of a frame that was never published."""
        for place in places:
            if place is not None:
                self._ctl[SLOT_BASE + place[1]] = FREE
        self.reap()

    def reap(self) -> None:
        """Return the extents of slots the receiver gave back to the free list."""
        ctl, freed = self._ctl, []
        for slot in self._lent:
            if ctl[SLOT_BASE + slot] == FREE:
                freed.append(slot)
        for slot in freed:
            self._free.append(self._lent.pop(slot))
            self._slots.append(slot)

    def in_use(self) -> int:
        """Bytes of the area lent or in flight now (for tests and statistics)."""
        return sum(size for _, size in self._lent.values())

    def _reserve_one(self, nbytes: int) -> tuple[int, int] | None:
        size = -(-nbytes // PAGE) * PAGE
        # Extents given back are preferred to space never used: the area's pages are
        # committed (and first written, which costs a fault each) only as it must grow.
        offset = self._take_free(size) if self._slots else None
        if offset is None:
            self.reap()
            if not self._slots:
                return None
            offset = self._take_free(size)
        if offset is None:
            offset = self._take_top(size)
        if offset is None:
            self._coalesce()  # may also lower the top
            offset = self._take_free(size)
        if offset is None:
            offset = self._take_top(size)
        if offset is None:
            return None
        slot = self._slots.pop()
        self._lent[slot] = (offset, size)
        self._ctl[SLOT_BASE + slot] = LENT
        return offset, slot

    def _take_free(self, size: int) -> int | None:
        """The best-fitting free extent (split when larger than ``size``)."""
        free, best = self._free, -1
        for index, (_, extent) in enumerate(free):
            if extent >= size and (best < 0 or extent < free[best][1]):
                best = index
                if extent == size:
                    break
        if best < 0:
            return None
        offset, extent = free[best]
        if extent > size:
            free[best] = (offset + size, extent - size)
        else:
            free.pop(best)
        return offset

    def _take_top(self, size: int) -> int | None:
        """Space never used yet, at the top of what the area has used so far."""
        if self._top + size > self._capacity:
            return None
        offset, self._top = self._top, self._top + size
        return offset

    def _coalesce(self) -> None:
        merged: list[tuple[int, int]] = []
        for offset, size in sorted(self._free):
            if merged and merged[-1][0] + merged[-1][1] == offset:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((offset, size))
        if merged and merged[-1][0] + merged[-1][1] == self._top:
            self._top = merged.pop()[0]
        self._free = merged


class LentViews:
    """The receiver's side: a lent buffer as a view of the area, or a copy past the limit."""

    def __init__(self, region: SharedRegion, hold_limit: int) -> None:
        self.ctl = region.ctl
        self.held = 0  # bytes of this channel's extents that users hold now
        # The root arrays are views of the region's mmap. Reached through the region,
        # which lets go of it when released: from then on only the roots hold the
        # mapping, and the last of them to die unmaps it.
        self._region = region
        self._start = region.lend_start
        self._hold_limit = hold_limit
        self._frombuffer: Any = None
        self._uint8: Any = None

    def take(self, offset: int, slot: int, length: int) -> Any:
        """The buffer at ``offset``: an ndarray over shared memory, or a bytearray copy."""
        holding = _holding
        uint8 = self._uint8
        if uint8 is None:
            import numpy

            self._frombuffer = numpy.frombuffer
            uint8 = self._uint8 = numpy.dtype(numpy.uint8)
        with holding.lock:
            lend = self.held == 0 or self.held + length <= self._hold_limit
            if lend:
                self.held += length
                holding.lent += 1
                holding.held_buffers += 1
                holding.held_bytes += length
            else:
                holding.copied += 1
        start = self._start + offset
        mapping = self._region.mapping
        if not lend:
            try:
                with memoryview(mapping) as whole:
                    return bytearray(whole[start : start + length])
            finally:
                self.ctl[SLOT_BASE + slot] = FREE
        root = self._frombuffer(mapping, uint8, length, start)  # keywords cost it 0.3 us more
        ref = weakref.ref(root, _give_back)
        holding.roots[id(ref)] = (ref, self, slot, length)
        return root

    def count_copied(self) -> None:
        """A buffer large enough to lend came through the ring: the sender had no free
        extent or slot for it."""
        with _holding.lock:
            _holding.copied += 1

    def discard(self, slot: int) -> None:
        """A lent buffer of a message that is dropped unread."""
        self.ctl[SLOT_BASE + slot] = FREE
