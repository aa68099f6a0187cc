"""A buffer built straight into the lend area (``Sender.borrow``): sent without a copy,
given back whether it was sent or not, never waited for. On both transports that lend
(the rings and the pipes), torch-free: the producer here is numpy."""

from __future__ import annotations

import gc
import multiprocessing

import numpy as np
import pytest

from mprs_plus.transport import _lend
from mprs_plus.transport.pipe import open_pipe_channel
from mprs_plus.transport.shm import open_shm_channel

FORK = multiprocessing.get_context("fork")
RING = 1 << 20  # the lend area is LEND_FACTOR times this; unsent borrows are held to RING
ITEM = 256 << 10  # lent (>= LEND_MIN)


@pytest.fixture(params=[open_shm_channel, open_pipe_channel], ids=["shm", "pipe"])
def channel(request):
    sender, receiver = request.param(FORK, capacity_items=64, capacity_bytes=RING)
    yield sender, receiver
    sender.close()
    receiver.close()


def built_in(buffer, value: int) -> np.ndarray:
    """What a producer does with a borrowed buffer: an array over it, filled."""
    array = np.frombuffer(buffer, dtype=np.int32)
    array[:] = np.arange(array.size, dtype=np.int32) + value
    return array


def test_a_buffer_built_in_a_borrowed_extent_is_sent_without_a_copy(channel):
    sender, receiver = channel
    buffer = sender.borrow(ITEM)
    assert buffer is not None and len(buffer) == ITEM
    array = built_in(buffer, 11)
    del buffer
    before = sender.traffic()
    sender.send(array)
    item = receiver.recv(timeout=30)
    assert (item == np.arange(ITEM // 4, dtype=np.int32) + 11).all()
    after = sender.traffic()
    assert after.lent_in_place == before.lent_in_place + 1
    assert after.lent_copied == before.lent_copied  # the sender copied nothing
    assert receiver.traffic() == after  # both ends report it
    # Both ends hold it: the extent waits for both to let go.
    del item
    assert sender.lent_extents() > 0
    del array
    gc.collect()
    assert sender.lent_extents() == 0


def test_the_extent_waits_for_the_producer_too(channel):
    """The receiver dropped the item, the producer still holds its array: the extent is
    not refilled under the producer."""
    sender, receiver = channel
    array = built_in(sender.borrow(ITEM), 3)
    sender.send(array)
    receiver.recv(timeout=30)  # read and dropped at once
    for i in range(40):  # 10 MiB through a 4 MiB area: every free extent is reused
        sender.send(np.full(ITEM, i, dtype=np.uint8))
        assert (receiver.recv(timeout=30) == i).all()
    assert (array == np.arange(ITEM // 4, dtype=np.int32) + 3).all()
    del array
    assert sender.lent_extents() == 0


def test_a_borrowed_extent_dropped_unsent_is_free_again(channel):
    sender, _receiver = channel
    buffer = sender.borrow(ITEM)
    array = built_in(buffer, 1)
    assert sender.lent_extents() >= ITEM
    del buffer, array  # the batch was dropped, or the code after it raised
    assert sender.lent_extents() == 0


def test_borrowing_with_no_room_gives_none_at_once(channel):
    sender, receiver = channel
    held = [sender.borrow(ITEM) for _ in range(RING // ITEM)]  # unsent borrows up to the ring's size
    assert all(buffer is not None for buffer in held)
    assert sender.borrow(ITEM) is None  # past it: never a wait
    assert sender.borrow(_lend.LEND_MIN - 1) is None  # too small to lend: build it anywhere
    assert sender.borrow(_lend.LEND_FACTOR * RING + _lend.LEND_MIN) is None  # larger than the area
    del held
    assert sender.lent_extents() == 0
    # A buffer larger than what unsent borrows may hold goes when none is held.
    big = sender.borrow(2 * RING)
    assert big is not None
    sender.send(big)
    assert len(receiver.recv(timeout=30)) == 2 * RING


def test_a_buffer_sent_twice_is_copied_the_second_time(channel):
    """An extent is published in place once; the same bytes again are an ordinary copy."""
    sender, receiver = channel
    array = built_in(sender.borrow(ITEM), 5)
    sender.send((array, array[: ITEM // 8]))
    first, second = receiver.recv(timeout=30)
    traffic = sender.traffic()
    assert traffic.lent_in_place == 1 and traffic.lent_copied == 1
    assert (first[: second.size] == second).all()
    sender.send(array)
    third = receiver.recv(timeout=30)
    assert sender.traffic().lent_copied == 2
    assert (third == first).all()
    del first, second, third, array
    assert sender.lent_extents() == 0


@pytest.mark.parametrize("opener", [open_shm_channel, open_pipe_channel], ids=["shm", "pipe"])
def test_a_send_that_times_out_leaves_the_borrow_with_its_producer(opener):
    sender, receiver = opener(FORK, capacity_items=1, capacity_bytes=RING)
    try:
        sender.send("first")  # the one message the channel holds
        array = built_in(sender.borrow(ITEM), 9)
        with pytest.raises(TimeoutError):
            sender.send(array, timeout=0)
        assert sender.traffic().lent_in_place == 0
        assert receiver.recv(timeout=30) == "first"
        sender.send(array, timeout=30)  # still its own: now it goes, in place
        assert sender.traffic().lent_in_place == 1
        item = receiver.recv(timeout=30)
        assert (item == np.arange(ITEM // 4, dtype=np.int32) + 9).all()
        del item, array
        assert sender.lent_extents() == 0
    finally:
        sender.close()
        receiver.close()


def test_a_borrowed_buffer_crosses_to_another_process(channel):
    sender, receiver = channel
    array = built_in(sender.borrow(ITEM), 21)
    sender.send(array)
    del array
    child = FORK.Process(target=_check_and_report, args=(receiver, 21))
    child.start()
    receiver.release()
    child.join(60)
    assert child.exitcode == 0
    assert sender.lent_extents() == 0


def _check_and_report(receiver, value: int) -> None:
    item = receiver.recv(timeout=30)
    ok = (item == np.arange(ITEM // 4, dtype=np.int32) + value).all()
    del item
    receiver.close()
    raise SystemExit(0 if ok else 1)


def test_a_child_forked_while_the_producer_holds_a_borrowed_buffer_keeps_its_bytes(channel):
    """The child inherits the producer's array over the extent; once the parent is done
    with it and the extent is refilled, the child's array still holds what it held, and
    the child's writes stay its own."""
    sender, receiver = channel
    array = built_in(sender.borrow(ITEM), 4)
    refilled = FORK.Event()
    child = FORK.Process(target=_check_inherited, args=(array, refilled, 4))
    child.start()
    sender.send(array)
    receiver.recv(timeout=30)  # read and dropped
    del array
    for i in range(40):  # 10 MiB through a 4 MiB area: the extent is reused once free
        sender.send(np.full(ITEM, 200 + i % 50, dtype=np.uint8))
        assert (receiver.recv(timeout=30) == 200 + i % 50).all()
    refilled.set()
    child.join(60)
    assert child.exitcode == 0
    assert sender.lent_extents() == 0


def _check_inherited(array: np.ndarray, refilled, value: int) -> None:
    expected = np.arange(array.size, dtype=np.int32) + value
    if not refilled.wait(60):
        raise SystemExit(2)
    intact = bool((array == expected).all())
    array[:] = -1  # private pages: the parent's area never sees this
    raise SystemExit(0 if intact else 1)
