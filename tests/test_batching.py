"""No item waits for a later one: batches are handed on within ``max_delay`` (or at once when
the reader sleeps), whatever the producer does next; an item that cannot be sent is named."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

import pipelines
from mprs_plus import MultiProcessingReadingService
from mprs_plus.runtime.child.batching import Batcher
from mprs_plus.runtime.data_messages import Kind
from mprs_plus.transport import open_channel, wait_readable
from mprs_plus.transport import _ring

FORK = multiprocessing.get_context("fork")


@pytest.fixture
def channel():
    sender, receiver = open_channel(FORK, capacity_items=4, capacity_bytes=1 << 16)
    yield sender, receiver
    sender.close()
    receiver.close()


def test_a_held_item_is_handed_on_within_max_delay_while_the_producer_is_busy(channel):
    sender, receiver = channel
    batcher = Batcher(sender, 7, max_items=64, max_delay=0.05)
    started = time.monotonic()
    batcher.add("first")  # the reader is awake (not waiting): the item is held...
    # ...and the producer now computes its next item for a long time: it does not call the
    # batcher again. The flusher must send the held item on its own.
    assert wait_readable([receiver], timeout=5) == [receiver]
    waited = time.monotonic() - started
    assert receiver.recv(timeout=0) == (Kind.ITEMS, 7, ["first"])
    assert 0.04 <= waited < 2.0


def test_an_item_goes_at_once_when_the_reader_is_asleep():
    # The shared-memory rings' behaviour, whatever MPRS_PLUS_TRANSPORT says: a reader asleep
    # on a pipe is not visible to its sender (``PipeSender.peer_waiting``), which relies on
    # the batch's timer there.
    from mprs_plus.transport.shm import open_shm_channel

    sender, receiver = open_shm_channel(FORK, capacity_items=4, capacity_bytes=1 << 16)
    try:
        batcher = Batcher(sender, 0, max_items=64, max_delay=60.0)  # the timer would take a minute
        got = []
        reader = threading.Thread(target=lambda: got.append(receiver.recv(timeout=30)))
        reader.start()
        deadline = time.monotonic() + 30
        while not receiver._ctl[_ring.RX_SLEEPING]:  # the reader blocks, its flag is set
            assert time.monotonic() < deadline
            os.sched_yield()
        batcher.add("wanted now")
        reader.join(10)
        assert got == [(Kind.ITEMS, 0, ["wanted now"])]
    finally:
        sender.close()
        receiver.close()


def test_a_producer_blocked_on_one_channel_does_not_hold_back_another_channels_items():
    # The dispatcher's situation: it deals item 1 to worker B (held in B's batch), then
    # blocks writing worker A's full channel. B's reader must get item 1 meanwhile, or a
    # main process waiting for B's turn never reads A and nobody moves again.
    a_tx, a_rx = open_channel(FORK, capacity_items=1, capacity_bytes=1 << 16)
    b_tx, b_rx = open_channel(FORK, capacity_items=4, capacity_bytes=1 << 16)
    a = Batcher(a_tx, 0, max_items=1, max_delay=0.01)
    b = Batcher(b_tx, 0, max_items=64, max_delay=0.01)
    a.add("fills A")

    def producer():
        b.add("for B")
        a.add("blocks on A")  # A is full until its reader reads

    thread = threading.Thread(target=producer, daemon=True)
    thread.start()
    try:
        assert b_rx.recv(timeout=5) == (Kind.ITEMS, 0, ["for B"])
        assert thread.is_alive()  # still blocked on A: B's item did not wait for it
        assert a_rx.recv(timeout=5) == (Kind.ITEMS, 0, ["fills A"])
        assert a_rx.recv(timeout=5) == (Kind.ITEMS, 0, ["blocks on A"])
    finally:
        thread.join(10)
        for end in (a_tx, a_rx, b_tx, b_rx):
            end.close()


def test_small_items_still_travel_in_batches(channel):
    sender, receiver = channel
    batcher = Batcher(sender, 0, max_items=8, max_delay=60.0)
    for i in range(16):
        batcher.add(i)
    assert receiver.recv(timeout=5) == (Kind.ITEMS, 0, list(range(8)))
    assert receiver.recv(timeout=5) == (Kind.ITEMS, 0, list(range(8, 16)))


def test_an_item_that_cannot_be_sent_is_named_and_the_ones_before_it_arrive(channel):
    sender, receiver = channel
    batcher = Batcher(sender, 3, max_items=4, max_delay=60.0, where="worker 1 (pid 42)", to="the main process")
    batcher.add("a")
    batcher.add("b")
    batcher.add("c")
    batcher.add("d")  # a whole batch: sent
    batcher.add("e")
    batcher.add((x for x in []))
    batcher.add("dropped")
    batcher.finish(Kind.END)  # the epoch ended in an ERROR: no END after it
    assert receiver.recv(timeout=5) == (Kind.ITEMS, 3, ["a", "b", "c", "d"])
    assert receiver.recv(timeout=5) == (Kind.ITEMS, 3, ["e"])
    kind, epoch, error = receiver.recv(timeout=5)
    assert (kind, epoch) == (Kind.ERROR, 3)
    exc = error.rebuild()
    assert isinstance(exc, TypeError)
    text = str(exc)
    assert "worker 1 (pid 42)" in text
    assert "item 5 " in text and "builtins.generator" in text and "to the main process" in text
    assert "cannot pickle 'generator' object" in text
    assert not receiver.poll()


# -- through the service -------------------------------------------------------------------


# Set by the test once it holds item 0; forked workers inherit it (a module global).
_FIRST_RECEIVED = multiprocessing.get_context("fork").Event()
_WAIT_S = 20.0


def _after_the_first_is_received(item: int) -> int:
    """Every item but 0 waits until the main process has received item 0."""
    if item != 0 and not _FIRST_RECEIVED.wait(_WAIT_S):
        raise TimeoutError(f"item {item}: the main process never received item 0 (held back in a batch?)")
    return item


@pytest.mark.timeout(60)
def test_the_first_of_slow_items_arrives_when_it_is_ready_not_with_the_next():
    """The next items cannot be made until the first has reached the main process, so a
    worker that held item 0 back to batch it with its next item would never send it: the
    read would fail with the workers' TimeoutError instead of yielding item 0."""
    _FIRST_RECEIVED.clear()
    pipe = IterableWrapper(range(6)).sharding_filter().map(_after_the_first_is_received)
    loader = DataLoader2(pipe, reading_service=MultiProcessingReadingService(2, multiprocessing_context="fork"))
    try:
        iterator = iter(loader)
        assert next(iterator) == 0
        _FIRST_RECEIVED.set()
        assert list(iterator) == [1, 2, 3, 4, 5]
        # The workers slept and woke; no wake-up needed the watchdog.
        processes = loader.reading_service.stats().processes
        assert processes and all(process.rescues == 0 for process in processes)
    finally:
        _FIRST_RECEIVED.set()
        loader.shutdown()


@pytest.mark.timeout(60)
def test_a_failed_send_through_the_service_names_worker_item_and_type():
    pipe = IterableWrapper(range(10)).sharding_filter().map(pipelines.unpicklable_at_5)
    loader = DataLoader2(pipe, reading_service=MultiProcessingReadingService(2))
    got = []
    try:
        with pytest.raises(TypeError) as info:
            for item in loader:
                got.append(item)
        assert got == [0, 1, 2, 3, 4]
        text = str(info.value)
        assert "worker process 1" in text and "item 2 " in text and "generator" in text
        assert "to the main process" in text and "cannot pickle 'generator' object" in text
    finally:
        loader.shutdown()
