"""The channel's contract within one process and with one forked producer: round trips,
order, backpressure by items and by bytes, end of stream, closing, poll and waiting."""

from __future__ import annotations

import collections
import decimal
import fractions
import multiprocessing
import os
import threading

import pytest
from transport_peers import FailsToUnpickle, Sleeps, produce, ring_sender_sleeps, shm_only, wait_until

from mprs_plus.transport import (
    ChannelBroken,
    ChannelClosed,
    EndOfStream,
    open_channel,
    register_reducer,
    wait_readable,
)
from mprs_plus.transport import _ring

FORK = multiprocessing.get_context("fork")
Point = collections.namedtuple("Point", "x y")


class Custom:
    def __init__(self, value: object) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Custom) and other.value == self.value


@pytest.fixture
def channel():
    sender, receiver = open_channel(FORK, capacity_items=64, capacity_bytes=1 << 20)
    yield sender, receiver
    sender.close()
    receiver.close()


VALUES = [
    0,
    -1,
    2**100,
    1.5,
    float("inf"),
    complex(1, 2),
    True,
    None,
    "",
    "text with ünïcode",
    b"",
    b"\x00" * 5000,  # above the out-of-band limit, but bytes pickle in the stream
    bytearray(b"abc" * 3000),  # a buffer: goes out of band
    (),
    (1, (2, (3,))),
    [1, "a", None],
    {"a": [1, 2], 3: {4}},
    {1, 2, 3},
    frozenset({"x"}),
    range(3, 30, 3),
    Point(1, 2),
    decimal.Decimal("1.10"),
    fractions.Fraction(1, 3),
    Custom([1, 2]),
    ValueError("boom"),
    list(range(10_000)),
]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_round_trip(channel, value):
    sender, receiver = channel
    sender.send(value)
    out = receiver.recv(timeout=5)
    if isinstance(value, Exception):
        assert type(out) is type(value) and out.args == value.args
    else:
        assert out == value and type(out) is type(value)


def test_shared_references_survive(channel):
    sender, receiver = channel
    shared = [1, 2]
    sender.send((shared, shared))
    first, second = receiver.recv(timeout=5)
    assert first is second


def test_order_is_kept_across_many_laps_of_the_ring():
    sender, receiver = open_channel(FORK, capacity_items=1000, capacity_bytes=1)  # smallest ring
    try:
        expected = []
        for lap in range(40):
            batch = [(lap, i, "x" * (i * 37 % 300)) for i in range(50)]
            for item in batch:
                sender.send(item)
            expected += batch
            assert [receiver.recv(timeout=5) for _ in batch] == batch
        assert not receiver.poll()
    finally:
        sender.close()
        receiver.close()


def test_end_of_stream_after_everything_was_delivered(channel):
    sender, receiver = channel
    for i in range(5):
        sender.send(i)
    sender.close()
    sender.close()  # idempotent
    assert receiver.poll()
    assert [receiver.recv(timeout=5) for _ in range(5)] == list(range(5))
    for _ in range(2):  # and stays ended
        with pytest.raises(EndOfStream):
            receiver.recv(timeout=5)
    assert receiver.poll()


def test_closed_endpoints_say_so(channel):
    sender, receiver = channel
    sender.close()
    with pytest.raises(ChannelClosed):
        sender.send(1)
    receiver.close()
    receiver.close()
    with pytest.raises(ChannelClosed):
        receiver.recv()
    with pytest.raises(ChannelClosed):
        receiver.poll()


def test_released_endpoints_are_closed_here_without_ending_the_stream(channel):
    sender, receiver = channel
    sender.send(1)
    sender.release()
    with pytest.raises(ChannelClosed):
        sender.send(2)
    assert receiver.recv(timeout=5) == 1
    # No end of stream was sent: with every sending handle gone, the stream is broken.
    with pytest.raises(ChannelBroken):
        receiver.recv(timeout=5)


def test_a_closed_receiver_breaks_the_sender(channel):
    sender, receiver = channel
    receiver.close()
    with pytest.raises(ChannelBroken, match="receiver closed"):
        sender.send(1)


def test_recv_timeout_and_poll(channel):
    sender, receiver = channel
    assert not receiver.poll()
    with pytest.raises(TimeoutError):
        receiver.recv(timeout=0)
    with pytest.raises(TimeoutError):
        receiver.recv(timeout=0.01)
    sender.send("x")
    assert receiver.poll()
    assert receiver.recv(timeout=0) == "x"
    assert not receiver.poll()


@shm_only
def test_wait_readable(channel):
    sender, receiver = channel
    other_sender, other_receiver = open_channel(FORK, capacity_items=4, capacity_bytes=4096)
    try:
        assert wait_readable([receiver, other_receiver], timeout=0.01) == []
        other_sender.send(1)
        assert wait_readable([receiver, other_receiver], timeout=5) == [other_receiver]
        read_fd, write_fd = os.pipe()
        try:
            os.write(write_fd, b"!")
            assert wait_readable([receiver], timeout=5, also=[read_fd]) == [read_fd]
        finally:
            os.close(read_fd)
            os.close(write_fd)
        # A sender in another thread wakes a receiver that is armed and asleep.
        asleep = Sleeps()
        thread = threading.Thread(target=lambda: (wait_until(asleep), sender.send(2)))
        thread.start()
        with asleep:
            assert wait_readable([receiver], timeout=30) == [receiver]
        thread.join()
        assert receiver.recv(timeout=0) == 2
    finally:
        other_sender.close()
        other_receiver.close()


def test_capacities_are_validated():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="capacity_items"):
            open_channel(FORK, capacity_items=bad, capacity_bytes=4096)
        with pytest.raises(ValueError, match="capacity_bytes"):
            open_channel(FORK, capacity_items=1, capacity_bytes=bad)


def test_a_message_that_fails_to_pickle_leaves_the_channel_usable(channel):
    sender, receiver = channel
    with pytest.raises(Exception):
        sender.send(lambda: None)
    with pytest.raises(Exception):  # fails after a buffer went out of band
        sender.send([bytearray(10_000), lambda: None])
    assert not receiver.poll()
    sender.send(["next", bytearray(b"n" * 5000)])
    assert receiver.recv(timeout=5) == ["next", bytearray(b"n" * 5000)]
    assert not receiver.poll()


def test_a_message_that_fails_to_unpickle_raises_and_is_consumed(channel):
    sender, receiver = channel
    sender.send(FailsToUnpickle())
    sender.send("after")
    with pytest.raises(RuntimeError, match="cannot rebuild"):
        receiver.recv(timeout=5)
    assert receiver.recv(timeout=5) == "after"


def test_register_reducer_is_used_by_channels_only(channel):
    class Meters(float):
        pass

    register_reducer(Meters, lambda value: (float, (float(value) * 100,)))
    sender, receiver = channel
    sender.send(Meters(1.5))
    assert receiver.recv(timeout=5) == 150.0
    import pickle

    with pytest.raises(Exception):  # a local class: plain pickle still refuses it
        pickle.dumps(Meters(1.5))


# -- backpressure, proven by the producer's state rather than by timing -----------------


def _start_producer(sender, receiver, items):
    counter = FORK.Value("i", 0)
    process = FORK.Process(target=produce, args=(sender, items, counter), daemon=True)
    process.start()
    sender.release()
    receiver.watch(process.sentinel)
    return process, counter


@shm_only
@pytest.mark.parametrize("capacity_items", [1, 3])
def test_backpressure_by_items(capacity_items):
    sender, receiver = open_channel(FORK, capacity_items=capacity_items, capacity_bytes=1 << 20)
    process, counter = _start_producer(sender, receiver, list(range(10)))
    try:
        for expected in range(10 - capacity_items):
            wait_until(lambda: ring_sender_sleeps(receiver))
            assert counter.value == expected + capacity_items  # full: exactly capacity in flight
            assert receiver.recv(timeout=30) == expected
        rest = [receiver.recv(timeout=30) for _ in range(capacity_items)]
        assert rest == list(range(10 - capacity_items, 10))
        with pytest.raises(EndOfStream):
            receiver.recv(timeout=30)
    finally:
        receiver.close()
        process.join(30)


@shm_only
@pytest.mark.parametrize("capacity_items", [1, 3, 8])
def test_backpressure_by_items_refilled_at_half(capacity_items):
    # Made with refill_at_half, a full producer sleeps until at most half its messages are
    # left unread: the reads before that leave it asleep (its flag still set: nobody woke
    # it), the last one wakes it.
    sender, receiver = open_channel(FORK, capacity_items=capacity_items, capacity_bytes=1 << 20, refill_at_half=True)
    process, counter = _start_producer(sender, receiver, list(range(20)))
    half = capacity_items // 2
    try:
        expected = 0
        while expected + capacity_items < 20:  # an item is left that it cannot send yet
            wait_until(lambda: ring_sender_sleeps(receiver))
            full = expected + capacity_items
            assert counter.value == full  # full: exactly capacity in flight
            for _ in range(capacity_items - half - 1):
                assert receiver.recv(timeout=30) == expected
                expected += 1
                assert ring_sender_sleeps(receiver) and counter.value == full  # not woken
            assert receiver.recv(timeout=30) == expected
            expected += 1
        rest = [receiver.recv(timeout=30) for _ in range(20 - expected)]
        assert rest == list(range(expected, 20))
        with pytest.raises(EndOfStream):
            receiver.recv(timeout=30)
    finally:
        receiver.close()
        process.join(30)


@shm_only
def test_backpressure_by_bytes():
    # The smallest ring (64 KiB) holds three 20 KiB messages, not four.
    sender, receiver = open_channel(FORK, capacity_items=100, capacity_bytes=1)
    assert receiver._size == 64 * 1024
    items = [bytes([i]) * (20 * 1024) for i in range(8)]
    process, counter = _start_producer(sender, receiver, items)
    try:
        wait_until(lambda: ring_sender_sleeps(receiver))
        assert counter.value == 3
        assert receiver.recv(timeout=30) == items[0]
        assert [receiver.recv(timeout=30) for _ in range(7)] == items[1:]
        with pytest.raises(EndOfStream):
            receiver.recv(timeout=30)
    finally:
        receiver.close()
        process.join(30)


def test_messages_larger_than_the_ring_stream_through_it():
    sender, receiver = open_channel(FORK, capacity_items=4, capacity_bytes=1)  # 64 KiB ring
    big_buffer = bytearray(os.urandom(1 << 20))  # out of band, 16 laps of the ring
    big_stream = list(range(50_000))  # a pickle stream several times the ring
    items = ["before", big_buffer, (big_stream, bytearray(b"tail" * 5000)), "after"]
    process, _ = _start_producer(sender, receiver, items)
    try:
        assert receiver.recv(timeout=30) == "before"
        assert receiver.recv(timeout=30) == big_buffer
        assert receiver.recv(timeout=30) == (big_stream, bytearray(b"tail" * 5000))
        assert receiver.recv(timeout=30) == "after"
        with pytest.raises(EndOfStream):
            receiver.recv(timeout=30)
    finally:
        receiver.close()
        process.join(30)


@shm_only
def test_the_ring_restarts_at_its_beginning_when_the_reader_keeps_up():
    sender, receiver = open_channel(FORK, capacity_items=4, capacity_bytes=8 << 20)
    try:
        payload = bytearray(300_000)
        for _ in range(20):
            sender.send(payload)
            assert receiver.recv(timeout=5) == payload
            assert receiver._ctl[_ring.READ_POS] % receiver._size <= 2 << 20
        assert receiver._ctl[_ring.READ_POS] > 2 << 20  # it did go round
    finally:
        sender.close()
        receiver.close()


def test_the_transport_imports_nothing_from_torch_or_torchdata():
    import ast
    from pathlib import Path

    import mprs_plus.transport

    for path in Path(mprs_plus.transport.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not [n for n in names if n.split(".")[0] in ("torch", "torchdata")], (path.name, names)


class _LookedAt:
    """A receiver stand-in for ``wait_together``: input from its ``input_from``-th look on
    (never, if None); it records how often it was looked at before it was first armed."""

    def __init__(self, input_from=None):
        self.input_from, self.looks, self.looks_before_arm, self.armed = input_from, 0, None, 0

    def has_input(self):
        self.looks += 1
        return self.input_from is not None and self.looks >= self.input_from

    def poll(self):
        return self.has_input()

    def arm(self):
        if self.looks_before_arm is None:
            self.looks_before_arm = self.looks
        self.armed += 1
        return None  # no waitable: looked at again, as a queue between threads is

    def disarm(self, woken, timed_out=False):
        pass


def _in_a_new_thread(call):
    """``call()`` in a thread of its own: a thread's spin record starts empty."""
    result = []
    thread = threading.Thread(target=lambda: result.append(call()))
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and len(result) == 1
    return result[0]


def test_a_wait_on_several_receivers_takes_input_that_came_while_it_spun_without_arming():
    """Input that arrives within the spin (here: at the second look) is taken at once: no
    receiver is armed, no sender has to wake anyone."""
    from mprs_plus.transport.channel import wait_together

    late, idle = _LookedAt(input_from=2), _LookedAt()
    assert _in_a_new_thread(lambda: wait_together([late, idle], timeout=5)) == [late]
    assert late.armed == idle.armed == 0


def test_a_wait_on_several_receivers_stops_spinning_after_spins_that_found_nothing(monkeypatch):
    """As a ring's own wait: after SPIN_MISSES spins in a row that found nothing, a wait
    arms at its first look (after one yield of its core) but in one wait out of
    SPIN_PROBE; the spin that finds input again brings spinning back."""
    from mprs_plus.transport import _wakeup
    from mprs_plus.transport.channel import wait_together

    yields: list[int] = []
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(1))

    def waits():
        looks, yielded = [], []
        for _ in range(_wakeup.SPIN_MISSES + 2):
            idle = _LookedAt()
            yields.clear()
            assert wait_together([idle, _LookedAt()], timeout=0.002) == []
            looks.append(idle.looks_before_arm)
            yielded.append(len(yields))
        found = _LookedAt(input_from=2)
        skipped = wait_together([found, _LookedAt()], timeout=5)  # no spin: armed, then found
        return looks, yielded, skipped == [found] and found.armed == 1

    looks, yielded, found_after_arming = _in_a_new_thread(waits)
    misses = _wakeup.SPIN_MISSES
    assert all(n >= 2 for n in looks[:misses])  # step 1, then at least one look of the spin
    assert looks[misses:] == [1, 1]  # straight to arming
    assert yielded[misses:] == [1, 1]  # after one yield of its core
    assert found_after_arming
