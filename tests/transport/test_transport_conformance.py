"""Every implementation of the channel protocols keeps one contract (``channel.py``): the
shared-memory rings, the OS pipes and the in-process queue, each opened directly (whatever
``MPRS_PLUS_TRANSPORT`` says), pass the same tests within one process. Waiting for
receivers of different transports together is tested at the end."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import threading
import time

import numpy as np
import pytest
from transport_peers import FailsToUnpickle, wait_until

from mprs_plus.transport import (
    ChannelBroken,
    ChannelClosed,
    EndOfStream,
    Receiver,
    Sender,
    wait_readable,
)
from mprs_plus.transport import _SHM_WORKS
from mprs_plus.transport.inprocess import open_inprocess_channel
from mprs_plus.transport.pipe import open_pipe_channel

FORK = multiprocessing.get_context("fork")
KINDS = ["shm", "pipe", "inprocess"]
PAGE_MULTIPLE = 1 << 16  # a capacity every transport keeps exactly (no rounding up)


def _open(kind, capacity_items=64, capacity_bytes=1 << 20):
    if kind == "shm":
        if not _SHM_WORKS:
            pytest.skip("the shared-memory transport needs Linux on x86-64")
        from mprs_plus.transport.shm import open_shm_channel

        return open_shm_channel(FORK, capacity_items=capacity_items, capacity_bytes=capacity_bytes)
    if kind == "pipe":
        return open_pipe_channel(FORK, capacity_items=capacity_items, capacity_bytes=capacity_bytes)
    return open_inprocess_channel(FORK, capacity_items=capacity_items, capacity_bytes=capacity_bytes)


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


@pytest.fixture
def opened(kind):
    """Opens channels of ``kind`` and closes every end at the end of the test."""
    ends = []

    def open_one(**capacity):
        sender, receiver = _open(kind, **capacity)
        ends.extend((sender, receiver))
        return sender, receiver

    yield open_one
    for end in ends:
        end.close()


@pytest.fixture
def ends(opened):
    return opened()


def _in_thread(target, *args):
    """Run ``target`` in a thread; returns a function that joins it and gives its result."""
    result = []

    def run():
        try:
            result.append(("ok", target(*args)))
        except BaseException as exc:  # handed to the test's thread
            result.append(("error", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join():
        thread.join(20)
        assert not thread.is_alive(), "the thread did not finish"
        outcome, value = result[0]
        if outcome == "error":
            raise value
        return value

    return join


def test_the_endpoints_implement_the_protocols(ends):
    sender, receiver = ends
    assert isinstance(sender, Sender)
    assert isinstance(receiver, Receiver)


def test_a_borrowed_buffer_or_none_and_what_is_built_there_arrives(ends):
    """``borrow`` gives a writable buffer of the size asked, or None where the transport
    has no memory to lend; either way the message built with it arrives equal."""
    sender, receiver = ends
    buffer = sender.borrow(256 << 10)
    if buffer is None:
        buffer = bytearray(256 << 10)  # what a producer does then: any memory of its own
    assert len(buffer) == 256 << 10
    array = np.frombuffer(buffer, dtype=np.uint8)
    array[:5] = list(b"built")
    sender.send(array)
    assert bytes(receiver.recv(timeout=5)[:5]) == b"built"


def test_messages_arrive_in_order_and_equal(ends):
    sender, receiver = ends
    values = [0, "text", b"\x00" * 5000, bytearray(b"abc" * 3000), {"a": [1, (2, 3)]}, None, 2**100]
    for value in values:
        sender.send(value)
    assert [receiver.recv(timeout=5) for _ in values] == values


def test_a_full_channel_by_items_times_out_and_sends_nothing(opened):
    sender, receiver = opened(capacity_items=3)
    for i in range(3):
        sender.send(i, timeout=0)
    with pytest.raises(TimeoutError):
        sender.send("no room", timeout=0)
    with pytest.raises(TimeoutError):
        sender.send("no room", timeout=0.05)
    assert sender.traffic().messages == 3
    assert receiver.recv(timeout=5) == 0
    sender.send(3, timeout=0)  # room again
    assert [receiver.recv(timeout=5) for _ in range(3)] == [1, 2, 3]
    assert not receiver.poll()


def test_a_full_channel_by_bytes_times_out(opened):
    sender, receiver = opened(capacity_items=100, capacity_bytes=PAGE_MULTIPLE)
    chunk = b"x" * 20_000  # pickles in the stream: three fit in 64 KiB, four do not
    for _ in range(3):
        sender.send(chunk, timeout=0)
    with pytest.raises(TimeoutError):
        sender.send(chunk, timeout=0)
    assert receiver.recv(timeout=5) == chunk
    sender.send(chunk, timeout=0)
    assert [len(receiver.recv(timeout=5)) for _ in range(3)] == [20_000] * 3


def test_a_message_larger_than_the_channel_goes_through(opened):
    sender, receiver = opened(capacity_items=4, capacity_bytes=PAGE_MULTIPLE)
    big = os.urandom(5 * PAGE_MULTIPLE)
    join = _in_thread(lambda: [receiver.recv(timeout=20) for _ in range(2)])
    sender.send(big, timeout=20)
    sender.send("after", timeout=20)
    assert join() == [big, "after"]


def test_a_blocked_sender_goes_on_once_the_reader_makes_room(opened):
    sender, receiver = opened(capacity_items=1)
    sender.send("first")
    join = _in_thread(sender.send, "second", 20)
    assert receiver.recv(timeout=5) == "first"
    join()
    assert receiver.recv(timeout=5) == "second"


def test_recv_times_out_on_an_empty_channel(ends):
    sender, receiver = ends
    assert not receiver.poll()
    assert not receiver.has_input()
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        receiver.recv(timeout=0.05)
    assert time.monotonic() - started >= 0.05
    sender.send("late")
    assert receiver.poll() and receiver.has_input()
    assert receiver.recv(timeout=0) == "late"


def test_skip_drops_one_whole_message_without_blocking(ends):
    sender, receiver = ends
    assert receiver.skip() is False
    sender.send(FailsToUnpickle())  # never unpickled by a skip
    sender.send("kept")
    assert receiver.skip() is True
    assert receiver.recv(timeout=5) == "kept"
    assert receiver.skip() is False
    sender.close()
    with pytest.raises(EndOfStream):
        receiver.skip()


def test_close_delivers_everything_then_the_end_of_stream(ends):
    sender, receiver = ends
    sender.send(1)
    sender.send(2)
    sender.close()
    sender.close()  # idempotent
    with pytest.raises(ChannelClosed):
        sender.send(3)
    assert receiver.recv(timeout=5) == 1
    assert receiver.recv(timeout=5) == 2
    assert receiver.poll()
    for _ in range(2):
        with pytest.raises(EndOfStream):
            receiver.recv(timeout=5)


def test_a_closed_receiver_breaks_its_sender_and_refuses_reads(ends):
    sender, receiver = ends
    sender.send("unread")
    receiver.close()
    receiver.close()
    with pytest.raises(ChannelBroken):
        sender.send("nobody reads this", timeout=5)
    with pytest.raises(ChannelClosed):
        receiver.recv(timeout=0)


def test_a_sender_gone_without_closing_is_a_broken_peer_after_the_buffered_messages(ends):
    sender, receiver = ends
    sender.send("buffered")
    sender.release()  # this process held its only handle: the stream has no writer any more
    assert receiver.recv(timeout=5) == "buffered"
    assert receiver.poll()
    with pytest.raises(ChannelBroken):
        receiver.recv(timeout=5)


def test_a_watched_waitable_ends_a_blocked_recv_as_a_broken_peer(ends):
    _, receiver = ends
    read_fd, write_fd = os.pipe()
    try:
        receiver.watch(read_fd)
        os.write(write_fd, b"!")
        with pytest.raises(ChannelBroken):
            receiver.recv(timeout=10)
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_a_watched_waitable_ends_a_blocked_send_as_a_broken_peer(opened):
    sender, _ = opened(capacity_items=1)
    sender.send("fills it")
    read_fd, write_fd = os.pipe()
    try:
        sender.watch(read_fd)
        os.write(write_fd, b"!")
        with pytest.raises(ChannelBroken):
            sender.send("no room", timeout=10)
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_a_message_that_does_not_pickle_sends_nothing(ends):
    sender, receiver = ends
    with pytest.raises(TypeError):
        sender.send(threading.Lock())
    sender.send("next")
    assert receiver.recv(timeout=5) == "next"
    assert not receiver.poll()


def test_a_message_that_does_not_unpickle_is_consumed(ends):
    sender, receiver = ends
    sender.send(FailsToUnpickle())
    sender.send("next")
    with pytest.raises(Exception, match="cannot rebuild this"):
        receiver.recv(timeout=5)
    assert receiver.recv(timeout=5) == "next"


def test_traffic_counts_messages_and_those_still_queued(ends):
    sender, receiver = ends
    for i in range(3):
        sender.send(i)
    assert receiver.recv(timeout=5) == 0
    traffic = sender.traffic()  # the sender's figures are the channel's in every transport
    assert traffic.messages == 3
    assert traffic.queued_messages == 2
    assert traffic.bytes > 0 and traffic.queued_bytes > 0


def test_peer_waiting_says_the_reader_is_blocked_where_the_transport_can_tell(kind, ends):
    sender, receiver = ends
    assert not sender.peer_waiting()
    join = _in_thread(receiver.recv, 20)
    if kind == "pipe":
        assert not sender.peer_waiting()  # a pipe cannot tell: always False
    else:
        wait_until(sender.peer_waiting, timeout=20)
    sender.send("wake up")
    assert join() == "wake up"


@pytest.mark.parametrize("how", ["one receiver", "two receivers"])
def test_wait_readable_returns_the_ready_receivers_and_waitables(opened, how):
    sender, receiver = opened()
    other_sender, other_receiver = opened()
    waited = [receiver] if how == "one receiver" else [receiver, other_receiver]
    assert wait_readable(waited, timeout=0.01) == []
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, b"!")
        assert wait_readable(waited, timeout=5, also=[read_fd]) == [read_fd]
    finally:
        os.close(read_fd)
        os.close(write_fd)
    # A message sent while the reader waits wakes it.
    join = _in_thread(wait_readable, waited, 20)
    (other_sender if how == "two receivers" else sender).send("x")
    assert join() == [other_receiver if how == "two receivers" else receiver]


def test_wait_readable_sees_a_gone_sender(opened):
    sender, receiver = opened()
    _, idle = opened()
    join = _in_thread(wait_readable, [receiver, idle], 20)
    sender.release()
    assert join() == [receiver]
    with pytest.raises(ChannelBroken):
        receiver.recv(timeout=0)


@pytest.mark.parametrize("pair", [("shm", "inprocess"), ("pipe", "inprocess"), ("shm", "pipe")])
def test_receivers_of_different_transports_are_waited_for_together(pair):
    first, second = (_open(kind) for kind in pair)
    try:
        receivers = [first[1], second[1]]
        for sender, receiver in (first, second):
            assert wait_readable(receivers, timeout=0.01) == []
            join = _in_thread(wait_readable, receivers, 20)
            sender.send("here")
            assert join() == [receiver]
            assert receiver.recv(timeout=0) == "here"
    finally:
        for end in (*first, *second):
            end.close()


def test_a_receiver_without_a_waitable_is_served_by_the_bounded_re_check():
    # The in-process receiver gives nothing to block on: a wait that also covers a
    # descriptor must still notice its message, within the fallback's longest interval.
    sender, receiver = open_inprocess_channel(capacity_items=4, capacity_bytes=1 << 16)
    read_fd, write_fd = os.pipe()
    try:
        assert receiver.arm() is None
        receiver.disarm(False)
        join = _in_thread(wait_readable, [receiver], 20, [read_fd])
        wait_until(sender.peer_waiting, timeout=20)  # the waiter is armed
        sender.send("found")
        assert join() == [receiver]
    finally:
        os.close(read_fd)
        os.close(write_fd)
        sender.close()
        receiver.close()


def test_an_in_process_endpoint_refuses_to_travel():
    sender, receiver = open_inprocess_channel(capacity_items=1, capacity_bytes=1)
    for end in (sender, receiver):
        with pytest.raises(TypeError, match="threads of one process"):
            pickle.dumps(end)
