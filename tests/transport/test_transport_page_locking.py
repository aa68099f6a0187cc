"""Page-locked lend areas (``pin_memory=True``), through the transport's seam: a fake
locker whose fences pass only when the test says so stands in for the device.

What a user relies on: no extent is handed back to the sender while a copy enqueued
before its buffer was dropped may still read it; such extents count against the held
bound; the area is unlocked before it is unmapped, and only by the process that locked
it; buffers copied instead of lent land in memory the locker gives."""

from __future__ import annotations

import gc
import multiprocessing
import os
import threading
from collections.abc import Callable

import numpy as np
import pytest
from transport_peers import filled

from mprs_plus.transport import lending, open_channel
from mprs_plus.transport import _lend


FORK = multiprocessing.get_context("fork")
RING = 1 << 20
ITEM = 256 << 10  # lent (>= LEND_MIN)


class FakeLocker:
    """Records every call; a fence passes once the test calls ``finish``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.issued = 0
        self.finished = 0  # fences numbered below this have passed
        self.allocated: list[np.ndarray] = []
        # Run inside ``fence`` / ``passed``, where a device call may run a finalizer or
        # another thread may reap: what a test puts in the window.
        self.on_fence: Callable[[], object] | None = None
        self.on_passed: Callable[[], object] | None = None

    def register(self, address: int, nbytes: int) -> bool:
        self.calls.append(("register", (address, nbytes)))
        return True

    def unregister(self, address: int) -> None:
        self.calls.append(("unregister", address))

    def fence(self) -> int:
        hook, self.on_fence = self.on_fence, None
        if hook is not None:
            hook()
        self.issued += 1
        return self.issued

    def passed(self, token: int, blocked: set) -> bool:
        hook, self.on_passed = self.on_passed, None
        if hook is not None:
            hook()
        return token <= self.finished

    def finish(self) -> None:
        self.finished = self.issued

    def allocate(self, nbytes: int) -> np.ndarray:
        out = np.empty(nbytes, dtype=np.uint8)
        self.allocated.append(out)
        return out

    def count(self, name: str) -> int:
        return sum(1 for call, _ in self.calls if call == name)


@pytest.fixture
def locker():
    fake = FakeLocker()
    _lend.lock_pages_with(fake)
    yield fake
    _lend.lock_pages_with(None)
    fake.finish()  # whatever a test left waiting goes back, so the next test starts clean
    gc.collect()
    assert lending().awaiting_device == 0


@pytest.fixture
def channel(locker):
    sender, receiver = open_channel(FORK, capacity_items=64, capacity_bytes=RING)
    yield sender, receiver
    sender.close()
    receiver.close()


def slots_lent(sender) -> int:
    """Buffers (of ``filled``'s default size) whose extents the sender has not got back."""
    return sender.lent_extents() // len(filled(0))


def registered(locker: FakeLocker) -> list[tuple[int, int]]:
    """(address, bytes) of every range registered and not unregistered since."""
    ranges: dict[int, int] = {}
    for call, args in locker.calls:
        if call == "register":
            ranges[args[0]] = args[1]
        elif call == "unregister":
            ranges.pop(args, None)
    return sorted(ranges.items())


def within_one(ranges: list[tuple[int, int]], buffer: np.ndarray) -> bool:
    start = buffer.__array_interface__["data"][0]
    return any(address <= start and start + buffer.nbytes <= address + size for address, size in ranges)


def test_only_the_chunk_a_buffer_is_lent_from_is_registered(channel, locker):
    sender, receiver = channel
    assert locker.count("register") == 0  # nothing is locked before anything is lent
    items = []
    for value in range(3):
        sender.send(filled(value))
        items.append(receiver.recv(timeout=5))
        assert items[-1][0] == value
    ranges = registered(locker)
    locked = sum(size for _, size in ranges)
    assert locked < receiver._lent._region.lend_size  # not the whole area at the first lend
    assert locked <= 2 * sum(item.nbytes for item in items) + _lend.lock_chunk_ends(receiver._lent._region.lend_size)[0]
    assert all(within_one(ranges, item) for item in items)  # each in one registration
    assert all(address % os.sysconf("SC_PAGE_SIZE") == 0 for address, _ in ranges)


def test_what_is_locked_grows_with_what_is_held_and_is_all_unlocked_once_released(locker):
    sender, receiver = open_channel(FORK, capacity_items=64, capacity_bytes=RING)
    items = []
    try:
        held = 2 * RING // ITEM  # the receiver's held bound (HOLD_FACTOR rings): all lent
        for value in range(held):  # past the ring: the area grows into its later chunks
            sender.send(filled(value))
            items.append(receiver.recv(timeout=5))
        ranges = registered(locker)
        assert len(ranges) > 1
        assert all(within_one(ranges, item) for item in items)
        assert [int(item[0]) for item in items] == list(range(held))
    finally:
        del items
        gc.collect()
        locker.finish()
        lending()
        sender.close()
        receiver.close()
    assert registered(locker) == []  # every chunk unregistered, each once
    assert locker.count("register") == locker.count("unregister")


@pytest.mark.parametrize("seed", range(4))
def test_the_sender_never_places_an_extent_across_two_lock_chunks(seed):
    """Buffers of random sizes, some given back at random, in a channel made for a loader
    that pins: every extent lies within one chunk, so a lent tensor is page-locked memory
    of one registration."""
    rng = np.random.default_rng(seed)
    with _lend.pinning_receivers():
        sender, receiver = open_channel(FORK, capacity_items=64, capacity_bytes=RING)
    try:
        area = sender._area
        ends = _lend.lock_chunk_ends(receiver._lent._region.lend_size)
        assert area._chunk_ends == ends and len(ends) == _lend.LOCK_CHUNKS  # laid out in chunks
        starts = [0, *ends[:-1]]
        held: list[int] = []
        for _ in range(300):
            size = int(rng.integers(_lend.LEND_MIN, 3 * RING // 2))
            places = area.reserve([memoryview(np.empty(size, np.uint8))])
            if places is not None:
                offset, slot = places[0]
                chunk = next(i for i, end in enumerate(ends) if offset < end)
                assert starts[chunk] <= offset and offset + size <= ends[chunk], (offset, size, ends)
                held.append(slot)
            if held and (places is None or rng.random() < 0.5):
                slot = held.pop(int(rng.integers(len(held))))
                sender._region.ctl[_lend.SLOT_BASE + slot] = _lend.FREE  # the receiver gave it back
                area.reap()
    finally:
        sender.close()
        receiver.close()


def test_a_channel_made_for_a_loader_that_pins_copies_a_buffer_larger_than_its_largest_chunk(locker):
    """No chunk holds it, and an extent never straddles two: it crosses as a copy, into
    memory the locker gives (page-locked too)."""
    with _lend.pinning_receivers():
        sender, receiver = open_channel(FORK, capacity_items=64, capacity_bytes=RING)
    try:
        ends = _lend.lock_chunk_ends(receiver._lent._region.lend_size)
        largest = max(end - start for start, end in zip([0, *ends], ends))
        before = lending()
        # Larger than the ring too: streamed through it while this thread reads.
        producer = threading.Thread(target=sender.send, args=(np.full(largest + ITEM, 5, dtype=np.uint8),))
        producer.start()
        item = receiver.recv(timeout=5)
        producer.join(5)
        assert len(item) == largest + ITEM and (np.asarray(item) == 5).all()
        assert lending().lent == before.lent and lending().copied == before.copied + 1
        assert sender.lent_extents() == 0
    finally:
        sender.close()
        receiver.close()


def test_a_channel_made_for_no_loader_that_pins_is_one_piece(locker):
    """Made outside ``pinning_receivers()`` while no locker locks every receiver: a buffer
    larger than half the area (the largest lock chunk) is lent, not copied. A receiver that
    locks it all the same (a locker installed later) registers the whole area at once, so
    that buffer lies within one registration."""
    _lend.lock_pages_with(locker, marked_only=True)
    sender, receiver = open_channel(FORK, capacity_items=64, capacity_bytes=RING)
    try:
        size = receiver._lent._region.lend_size
        assert sender._area._chunk_ends == [size]
        _lend.lock_pages_with(locker)  # now every receiver locks, this one too
        before = lending()
        big = 3 * size // 4  # over the largest chunk (half the area) of a chunked one
        sender.send(np.full(big, 9, dtype=np.uint8))
        item = receiver.recv(timeout=5)
        assert item.nbytes == big and (item == 9).all()
        assert lending().lent == before.lent + 1 and lending().copied == before.copied
        ranges = registered(locker)
        assert [nbytes for _, nbytes in ranges] == [size] and within_one(ranges, item)
        del item
    finally:
        gc.collect()
        locker.finish()
        lending()
        sender.close()
        receiver.close()
    assert registered(locker) == []


def test_a_function_that_opens_channels_later_opens_them_as_they_were_opened_then():
    """A replacement worker's channels are opened long after the first ones, outside the
    context they were made in: ``pinning_as_now`` lays them out the same way."""

    def lock_chunked() -> int:
        sender, receiver = open_channel(FORK, capacity_items=4, capacity_bytes=RING)
        try:
            return int(sender._region.ctl[_lend.LOCK_CHUNKED])
        finally:
            sender.close()
            receiver.close()

    with _lend.pinning_receivers():
        pinning = _lend.pinning_as_now(lock_chunked)
    plain = _lend.pinning_as_now(lock_chunked)
    assert plain is lock_chunked
    assert (pinning(), plain()) == (1, 0)


def test_a_dropped_buffer_goes_back_only_after_its_fence_passes(channel, locker):
    sender, receiver = channel
    sender.send(filled(7))
    item = receiver.recv(timeout=5)
    assert slots_lent(sender) == 1
    del item
    gc.collect()
    # Dropped, but the device may still copy from it: the sender must not get it back.
    assert slots_lent(sender) == 1
    assert lending().awaiting_device == 1
    assert lending().held_bytes >= ITEM  # still counted against the held bound
    locker.finish()
    assert lending().awaiting_device == 0  # lending() reaps what passed
    assert slots_lent(sender) == 0


def test_a_fence_is_reaped_when_the_next_buffer_arrives(channel, locker):
    sender, receiver = channel
    sender.send(filled(1))
    first = receiver.recv(timeout=5)
    del first
    locker.finish()
    assert slots_lent(sender) == 1  # nothing has looked yet
    sender.send(filled(2))
    second = receiver.recv(timeout=5)
    assert second[0] == 2
    assert slots_lent(sender) == 1  # the first went back when the second was lent


@pytest.mark.parametrize("window", ["another reaper", "a root dropped by a finalizer"])
def test_a_fence_made_while_the_list_is_reaped_is_never_lost(channel, locker, window):
    """Making a fence runs device calls; meanwhile another thread may reap the waiting
    fences, or a finalizer may drop another lent buffer (and reap) on this thread. The
    buffer whose fence was being made must still go back only once it passed, and go
    back then: neither leaked nor freed early."""
    sender, receiver = channel
    items = []
    for value in range(3):
        sender.send(filled(value))
        items.append(receiver.recv(timeout=5))
    first, second, third = items
    del items
    del first  # waits for its fence: the reaper has something to look at
    gc.collect()
    assert lending().awaiting_device == 1
    dropped = [third]
    del third
    if window == "another reaper":
        locker.on_fence = _lend._reap_awaiting
    else:
        locker.on_fence = dropped.clear  # its finalizer runs inside this fence
    del second
    gc.collect()
    dropped.clear()
    gc.collect()
    assert lending().awaiting_device == 3
    assert slots_lent(sender) == 3
    locker.finish()
    assert lending().awaiting_device == 0
    assert slots_lent(sender) == 0


def test_a_buffer_dropped_by_a_finalizer_inside_the_reaper_waits_for_its_own_fence(channel, locker):
    """The reaper asks the device whether fences passed; a finalizer may run in that call
    and drop another lent buffer, whose fence is made after everything the reaper saw."""
    sender, receiver = channel
    items = []
    for value in range(2):
        sender.send(filled(value))
        items.append(receiver.recv(timeout=5))
    first, second = items
    del items
    del first
    gc.collect()
    locker.finish()  # the first buffer's fence passed; the second's is made later
    dropped = [second]
    del second
    locker.on_passed = dropped.clear
    assert lending().awaiting_device == 1  # the first went back; the second waits
    assert slots_lent(sender) == 1
    locker.finish()
    assert lending().awaiting_device == 0
    assert slots_lent(sender) == 0


def test_extents_awaiting_a_fence_count_against_the_held_bound(channel, locker):
    """Past the bound a buffer is copied, not lent, into memory the locker gives: memory
    stays bounded however long the device takes."""
    sender, receiver = channel
    limit = _lend.HOLD_FACTOR * RING
    lent_before = lending().lent
    for value in range(limit // ITEM):
        sender.send(filled(value))
        item = receiver.recv(timeout=5)
        assert item[0] == value
        del item  # dropped at once, but no fence passes
    assert lending().lent - lent_before == limit // ITEM
    allocated = len(locker.allocated)
    sender.send(filled(99))
    copy = receiver.recv(timeout=5)
    assert copy[0] == 99
    assert lending().lent - lent_before == limit // ITEM  # copied: the bound held
    assert len(locker.allocated) == allocated + 1  # ... into the locker's memory
    locker.finish()
    del copy
    sender.send(filled(100))
    assert receiver.recv(timeout=5)[0] == 100
    assert lending().lent - lent_before == limit // ITEM + 1  # lent again once fences passed


def test_the_area_is_unlocked_after_the_last_fence_and_before_it_is_unmapped(locker):
    sender, receiver = open_channel(FORK, capacity_items=64, capacity_bytes=RING)
    sender.send(filled(3))
    item = receiver.recv(timeout=5)
    sender.close()
    receiver.close()
    assert locker.count("unregister") == 0  # the user still holds a lent buffer
    assert item[0] == 3 and item[-1] == 3  # ... and it is still mapped
    del item
    gc.collect()
    assert locker.count("unregister") == 0  # dropped, but its fence has not passed
    locker.finish()
    lending()
    assert locker.count("unregister") == 1
    register = next(value for call, value in locker.calls if call == "register")
    assert ("unregister", register[0]) in locker.calls


def test_a_channel_released_with_nothing_held_is_unlocked_at_once(locker):
    sender, receiver = open_channel(FORK, capacity_items=64, capacity_bytes=RING)
    sender.send(filled(4))
    item = receiver.recv(timeout=5)
    del item
    locker.finish()
    lending()
    assert locker.count("unregister") == 0  # the channel is still open
    sender.close()
    receiver.close()
    assert locker.count("unregister") == 1


def test_a_forked_child_never_calls_the_locker(channel, locker):
    """The child inherits the lent buffer (it gets its own copy of the bytes) and the
    parent's locker object, but the device context is the parent's: nothing in the child
    may register, fence or unregister."""
    sender, receiver = channel
    sender.send(filled(5))
    item = receiver.recv(timeout=5)
    calls_before = list(locker.calls)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: read and drop the inherited buffer, release the channel
        ok = False
        try:
            ok = item[0] == 5 and _lend._locker is None
            del item
            receiver.release()
            gc.collect()
            ok = ok and locker.calls == calls_before and locker.issued == 0
        finally:
            os.write(write_end, b"1" if ok else b"0")
            os._exit(0)
    os.close(write_end)
    verdict = os.read(read_end, 1)
    os.close(read_end)
    os.waitpid(pid, 0)
    assert verdict == b"1"
    assert item[0] == 5


def test_without_a_locker_a_dropped_buffer_goes_back_at_once():
    sender, receiver = open_channel(FORK, capacity_items=64, capacity_bytes=RING)
    try:
        sender.send(filled(6))
        item = receiver.recv(timeout=5)
        assert slots_lent(sender) == 1
        del item
        gc.collect()
        assert slots_lent(sender) == 0
        assert lending().awaiting_device == 0
    finally:
        sender.close()
        receiver.close()
