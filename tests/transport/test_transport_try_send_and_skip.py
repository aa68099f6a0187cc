"""``send`` with a timeout and ``skip``: the two calls a stop needs so that it can never block.

Both transports keep the same contract, so every test runs on the shared-memory rings and
on the pipes."""

from __future__ import annotations

import multiprocessing
import time

import pytest
from transport_peers import Sleeps, wait_until

from mprs_plus.transport import note_blocking

from mprs_plus.transport import ChannelBroken, EndOfStream
from mprs_plus.transport.pipe import open_pipe_channel
from mprs_plus.transport.shm import open_shm_channel

FORK = multiprocessing.get_context("fork")
OPENERS = {"shm": open_shm_channel, "pipe": open_pipe_channel}


@pytest.fixture(params=sorted(OPENERS))
def transport(request):
    return request.param


def _open(transport, capacity_items=4, capacity_bytes=1 << 16):
    return OPENERS[transport](FORK, capacity_items=capacity_items, capacity_bytes=capacity_bytes)


def _fill(sender) -> int:
    """Send until the channel is full; the number of messages that fit."""
    sent = 0
    while True:
        try:
            sender.send(("filler", sent, b"x" * 1000), timeout=0)
        except TimeoutError:
            return sent
        sent += 1
        assert sent < 100_000, "the channel never filled up"


def test_send_with_a_timeout_gives_up_on_a_full_channel_and_writes_nothing(transport):
    sender, receiver = _open(transport)
    try:
        sent = _fill(sender)
        assert sent >= 1
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            sender.send("late", timeout=0.2)
        assert 0.15 <= time.monotonic() - started < 5
        got = [receiver.recv(timeout=5) for _ in range(sent)]
        assert [message[1] for message in got] == list(range(sent))
        sender.send("after", timeout=5)  # the channel is still usable
        assert receiver.recv(timeout=5) == "after"
        assert not receiver.poll()  # "late" was never written, not even in part
    finally:
        sender.close()
        receiver.close()


def test_send_with_timeout_zero_succeeds_at_once_when_there_is_room(transport):
    sender, receiver = _open(transport)
    try:
        sender.send({"a": 1}, timeout=0)
        assert receiver.recv(timeout=5) == {"a": 1}
    finally:
        sender.close()
        receiver.close()


def test_a_timed_send_waits_for_room_that_appears(transport):
    sender, receiver = _open(transport)
    try:
        sent = _fill(sender)
        process = FORK.Process(target=_drain, args=(receiver, sent + 1))
        process.start()
        receiver.release()
        try:
            sender.send("fits once the reader reads", timeout=30)
        finally:
            sender.close()
            process.join(30)
        assert process.exitcode == 0
    finally:
        sender.close()
        receiver.close()


def _drain(receiver, count) -> None:
    for _ in range(count):
        receiver.recv(timeout=30)


def test_skip_discards_whole_messages_in_order_without_unpickling(transport):
    sender, receiver = _open(transport, capacity_items=8, capacity_bytes=1 << 20)
    try:
        assert receiver.skip() is False  # nothing buffered: answers at once
        sender.send(_ExplodesWhenUnpickled())
        sender.send(bytearray(20_000))  # an out-of-band buffer (shm)
        sender.send("kept")
        assert receiver.skip() is True
        assert receiver.skip() is True
        assert receiver.recv(timeout=5) == "kept"
        assert receiver.skip() is False
        sender.close()
        with pytest.raises(EndOfStream):
            receiver.skip()
        with pytest.raises(EndOfStream):
            receiver.recv(timeout=5)
    finally:
        sender.close()
        receiver.close()


def test_skip_wakes_a_sender_waiting_for_room(transport):
    sender, receiver = _open(transport, capacity_items=1)
    try:
        sent = _fill(sender)
        asleep = Sleeps()
        process = FORK.Process(target=_send_blocking, args=(sender, "waited", asleep))
        process.start()
        sender.release()
        receiver.watch(process.sentinel)
        wait_until(asleep)  # the sender waits for room
        for _ in range(sent):
            wait_until(receiver.poll)
            assert receiver.skip() is True
        assert receiver.recv(timeout=30) == "waited"
        with pytest.raises(EndOfStream):
            receiver.recv(timeout=30)
        process.join(30)
        assert process.exitcode == 0
    finally:
        sender.close()
        receiver.close()


def _send_blocking(sender, obj, asleep=None) -> None:
    if asleep is not None:
        note_blocking(asleep.note)
    sender.send(obj)
    sender.close()


def test_skip_raises_channel_broken_when_the_sender_is_gone_and_nothing_is_buffered(transport):
    sender, receiver = _open(transport)
    process = FORK.Process(target=_send_blocking, args=(sender, "last words"))
    process.start()
    sender.release()
    process.join(30)
    try:
        # The process closed its sender cleanly: the message, then the end of the stream.
        wait_until(receiver.poll)
        assert receiver.skip() is True
        with pytest.raises(EndOfStream):
            receiver.skip()
    finally:
        receiver.close()
    sender, receiver = _open(transport)
    process = FORK.Process(target=_exit_without_closing, args=(sender,))
    process.start()
    sender.release()
    process.join(30)
    try:
        wait_until(receiver.poll)
        assert receiver.skip() is True  # what was sent before the end is still there
        with pytest.raises(ChannelBroken):
            receiver.skip()
    finally:
        receiver.close()


def _exit_without_closing(sender) -> None:
    sender.send("sent before dying")
    import os

    os._exit(0)


def test_skip_reads_a_message_larger_than_the_ring_through():
    sender, receiver = open_shm_channel(FORK, capacity_items=4, capacity_bytes=1)
    big = bytes(range(256)) * 4096  # 1 MiB, the ring is 64 KiB
    process = FORK.Process(target=_send_blocking_two, args=(sender, big, "after"))
    process.start()
    sender.release()
    try:
        receiver.watch(process.sentinel)
        wait_until(receiver.poll)
        assert receiver.skip() is True
        assert receiver.recv(timeout=30) == "after"
        process.join(30)
        assert process.exitcode == 0
    finally:
        receiver.close()


def _send_blocking_two(sender, first, second) -> None:
    sender.send(first)
    sender.send(second)
    sender.close()


class _ExplodesWhenUnpickled:
    def __reduce__(self):
        return (_explode, ())


def _explode():
    raise AssertionError("skip must not unpickle")


@pytest.mark.parametrize("capacity_items", [1, 3, 10])
def test_both_transports_hold_exactly_capacity_items_messages(transport, capacity_items):
    sender, receiver = _open(transport, capacity_items=capacity_items, capacity_bytes=1 << 20)
    try:
        assert _fill(sender) == capacity_items
        receiver.recv(timeout=5)
        assert _fill(sender) == 1  # one read makes room for exactly one
    finally:
        sender.close()
        receiver.close()


def test_both_transports_hold_as_many_bytes():
    # capacity_bytes is rounded up to the smallest ring (64 KiB) by both: three 20 KiB
    # messages fit, a fourth does not.
    held = []
    for transport in sorted(OPENERS):
        sender, receiver = _open(transport, capacity_items=100, capacity_bytes=1)
        try:
            count = 0
            while True:
                try:
                    sender.send(bytes(20 * 1024), timeout=0)
                except TimeoutError:
                    break
                count += 1
            held.append(count)
        finally:
            sender.close()
            receiver.close()
    assert held == [3, 3]
