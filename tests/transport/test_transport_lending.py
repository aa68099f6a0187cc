"""Large buffers handed over as views of the channel's lend area: what a user receives,
that no view is ever overwritten while it lives, that extents come back when items are
dropped, and that a consumer keeping every item never stalls the producer. On both
transports (the one ``MPRS_PLUS_TRANSPORT`` selects): the pipes lend as the rings do."""

from __future__ import annotations

import gc
import mmap
import multiprocessing
import pickle
import threading

import numpy as np
import pytest
import torch
from transport_peers import drop_inherited_lent_buffers, filled, send_filled, shm_only

import mprs_plus.runtime  # noqa: F401  registers the tensor reducers, as the service does
from mprs_plus.transport import EndOfStream, lending, open_channel, wait_readable
from mprs_plus.transport import _lend

FORK = multiprocessing.get_context("fork")
RING = 1 << 20  # a small ring: the lend area is LEND_FACTOR times this
ITEM = 256 << 10  # lent (>= LEND_MIN); 4 fit in the ring's in-flight budget


@pytest.fixture
def channel():
    sender, receiver = open_channel(FORK, capacity_items=64, capacity_bytes=RING)
    yield sender, receiver
    sender.close()
    receiver.close()


def as_bytes(view: object) -> bytes:
    if isinstance(view, torch.UntypedStorage):
        view = torch.empty((0,), dtype=torch.uint8).set_(view)
    if isinstance(view, torch.Tensor):
        view = view.numpy()
    return bytes(memoryview(view).cast("B"))


def backed_by_shared_memory(array: np.ndarray) -> bool:
    """The array's memory belongs to an mmap (the channel's), not to the array or a copy."""
    base = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return isinstance(base, mmap.mmap)


def test_a_large_array_arrives_as_a_view_of_shared_memory(channel):
    sender, receiver = channel
    before = lending()
    sender.send(filled(7))
    item = receiver.recv()
    assert item.dtype == np.uint8 and item.shape == (ITEM,) and (item == 7).all()
    assert not item.flags.owndata and backed_by_shared_memory(item)
    assert item.flags.writeable  # as a copied buffer would be
    during = lending()
    assert during.lent == before.lent + 1 and during.copied == before.copied
    assert during.held_bytes == before.held_bytes + ITEM
    del item
    after = lending()
    assert after.held_buffers == before.held_buffers and after.held_bytes == before.held_bytes


def test_a_small_array_is_copied(channel):
    sender, receiver = channel
    before = lending()
    sender.send(filled(3, _lend.LEND_MIN - 1))
    item = receiver.recv()
    assert (item == 3).all() and not backed_by_shared_memory(item)
    assert lending().lent == before.lent


def test_tensors_arrive_on_shared_memory_and_stay_aliased(channel):
    sender, receiver = channel
    x = torch.arange(ITEM // 4, dtype=torch.float32).reshape(256, -1)
    sender.send({"x": x, "xt": x.t(), "small": torch.ones(3)})
    got = receiver.recv()
    assert torch.equal(got["x"], x) and torch.equal(got["xt"], x.t()) and torch.equal(got["small"], torch.ones(3))
    assert got["x"].untyped_storage().data_ptr() == got["xt"].untyped_storage().data_ptr()
    # An ordinary tensor: it pickles, copies, and refuses to grow in place (its storage is
    # not resizable, as with any tensor made from a buffer).
    assert torch.equal(pickle.loads(pickle.dumps(got["x"])), x)
    assert torch.equal(got["x"].clone(), x)
    with pytest.raises(RuntimeError, match="not resizable"):
        # On an alias: torch sets the new sizes before it finds the storage not resizable,
        # and a tensor left claiming 4 MiB over its 256 KiB would read past its buffer.
        got["x"].view(got["x"].shape).resize_(1 << 20)
    assert got["x"].clone().resize_(1 << 20).numel() == 1 << 20


DERIVED = {
    "numpy view and reshape": lambda a: a.view(np.float32).reshape(64, -1),
    "slice": lambda a: a[100:200],
    "np.asarray": np.asarray,
    "np.frombuffer": lambda a: np.frombuffer(a, dtype=np.int32),
    "memoryview": memoryview,
    "torch.from_numpy": torch.from_numpy,
    "torch.frombuffer": lambda a: torch.frombuffer(a, dtype=torch.uint8),
    "tensor storage": lambda a: torch.from_numpy(a).untyped_storage(),
}


@pytest.mark.parametrize("derive", DERIVED.values(), ids=DERIVED.keys())
def test_whatever_is_built_on_a_lent_buffer_keeps_its_bytes(channel, derive):
    """The extent goes back only when the last view dies: after the root array is dropped,
    a view built on it must survive the producer cycling through the whole area."""
    sender, receiver = channel
    sender.send(filled(0))
    view = derive(receiver.recv())
    gc.collect()
    area_turns = 3 * _lend.LEND_FACTOR * RING // ITEM
    for i in range(1, area_turns):
        sender.send(filled(i))
        assert (receiver.recv() == i % 251).all()
    kept = as_bytes(view)
    assert kept == bytes(len(kept))  # still all zeros
    del view
    gc.collect()


def test_a_read_only_array_arrives_read_only(channel):
    sender, receiver = channel
    source = np.frombuffer(bytes(filled(9)), dtype=np.uint8)
    assert not source.flags.writeable
    before = lending()
    sender.send(source)
    item = receiver.recv()
    assert (item == 9).all() and not item.flags.writeable
    assert lending().lent == before.lent + 1
    del item
    assert lending().held_bytes == before.held_bytes


def test_extents_come_back_when_items_are_dropped(channel):
    sender, receiver = channel
    before = lending()
    for i in range(200):  # 50 MiB through a 4 MiB area
        sender.send(filled(i))
        assert (receiver.recv() == i % 251).all()
    after = lending()
    assert after.lent - before.lent == 200 and after.copied == before.copied
    assert sender.lent_extents() == 0


def test_skipped_messages_give_their_extents_back(channel):
    sender, receiver = channel
    before = lending()
    for i in range(3):
        sender.send((i, filled(i)))
    assert receiver.skip() and receiver.skip() and receiver.skip()
    assert sender.lent_extents() == 0
    assert lending().lent == before.lent


def test_a_send_that_times_out_reserves_nothing():
    sender, receiver = open_channel(FORK, capacity_items=1, capacity_bytes=RING)
    try:
        sender.send("first")  # the one message the channel holds
        with pytest.raises(TimeoutError):
            sender.send(filled(5), timeout=0)
        assert sender.lent_extents() == 0
        assert receiver.recv() == "first"
        sender.send(filled(5), timeout=0)
        assert (receiver.recv() == 5).all()
    finally:
        sender.close()
        receiver.close()


def test_lent_bytes_in_flight_count_against_the_ring(channel):
    """A producer cannot run ahead by more than the ring's size in lent bytes: the send
    that would pass it waits (here: times out) until the receiver reads."""
    sender, receiver = channel
    budget = RING // ITEM
    for i in range(budget):
        sender.send(filled(i), timeout=0)
    with pytest.raises(TimeoutError):
        sender.send(filled(budget), timeout=0)
    assert (receiver.recv() == 0).all()
    sender.send(filled(budget), timeout=0)
    assert [int(receiver.recv()[0]) for _ in range(budget)] == list(range(1, budget + 1))


def test_lent_bytes_in_flight_stop_at_lent_ahead_below_a_larger_ring(monkeypatch):
    """Below a ring larger than ``LENT_AHEAD``, a producer runs ahead by ``LENT_AHEAD`` of
    lent bytes, not the ring's size: what it writes, and its exit unmaps, stays that much.
    Messages larger than half of it go two at a time; one larger than the ring, alone."""
    monkeypatch.setattr(_lend, "LENT_AHEAD", 2 * ITEM)
    sender, receiver = open_channel(FORK, capacity_items=64, capacity_bytes=RING)  # RING: 4 items
    try:
        sender.send(filled(0), timeout=0)
        sender.send(filled(1), timeout=0)
        with pytest.raises(TimeoutError):
            sender.send(filled(2), timeout=0)
        assert sender.lent_extents() == 2 * ITEM
        assert (receiver.recv() == 0).all()
        sender.send(filled(2), timeout=0)
        assert [int(receiver.recv()[0]) for _ in range(2)] == [1, 2]
        larger = [np.full(3 * ITEM // 2, k, dtype=np.uint8) for k in (3, 4, 5)]
        sender.send(larger[0], timeout=0)
        sender.send(larger[1], timeout=0)  # two of them: 3 items' worth in flight
        with pytest.raises(TimeoutError):
            sender.send(larger[2], timeout=0)
        assert [int(receiver.recv()[0]) for _ in range(2)] == [3, 4]
        large = np.full(5 * ITEM, 6, dtype=np.uint8)  # larger than the ring: alone
        sender.send(large, timeout=0)
        with pytest.raises(TimeoutError):
            sender.send(filled(7), timeout=0)
        assert (receiver.recv() == 6).all()
    finally:
        sender.close()
        receiver.close()


@pytest.mark.timeout(60)
def test_a_consumer_that_keeps_every_item_completes(start_method):
    """``list(loader)``: the consumer holds everything. Past the hold limit the receiver
    copies, so the producer keeps getting extents back and the stream ends."""
    ctx = multiprocessing.get_context(start_method)
    sender, receiver = open_channel(ctx, capacity_items=16, capacity_bytes=RING)
    count = 20 * _lend.LEND_FACTOR * RING // ITEM  # 20 times the whole area
    producer = ctx.Process(target=send_filled, args=(sender, count, ITEM))
    producer.start()
    sender.release()
    before = lending()
    kept = []
    try:
        while True:
            kept.append(receiver.recv(timeout=30))
    except EndOfStream:
        pass
    finally:
        receiver.close()
        producer.join(30)
    assert producer.exitcode == 0
    assert len(kept) == count
    assert all((item == i % 251).all() for i, item in enumerate(kept))  # no view was overwritten
    after = lending()
    assert after.lent > before.lent and after.copied > before.copied
    assert after.lent - before.lent + after.copied - before.copied == count
    held = after.held_bytes - before.held_bytes
    assert 0 < held <= _lend.HOLD_FACTOR * RING  # the bound a receiver lends up to
    del kept
    assert lending().held_bytes == before.held_bytes


@pytest.mark.timeout(60)
def test_a_message_larger_than_the_ring_carries_lent_buffers_too():
    """Bytes pickle in the stream, so this frame is streamed through the ring while its
    array is lent."""
    sender, receiver = open_channel(FORK, capacity_items=16, capacity_bytes=RING)
    extra = b"x" * (3 * RING // 2)
    producer = FORK.Process(target=send_filled, args=(sender, 5, ITEM, extra))
    producer.start()
    sender.release()
    before = lending()
    try:
        got = [receiver.recv(timeout=30) for _ in range(3)]
        for _ in range(2):
            while not receiver.skip():
                wait_readable([receiver], timeout=1)
        with pytest.raises(EndOfStream):
            receiver.recv(timeout=30)
    finally:
        receiver.close()
        producer.join(30)
    assert producer.exitcode == 0
    assert all(e == extra and (a == i).all() for i, (e, a) in enumerate(got))
    assert lending().lent - before.lent == 3
    assert all(backed_by_shared_memory(a) for _, a in got)


@pytest.mark.timeout(60)
def test_a_tensor_over_half_the_lend_area_is_lent_through_a_channel_nobody_page_locks():
    """160 MiB through a channel of a worker's size (a 64 MiB ring, a 256 MiB lend area)
    made for a loader that does not pin: only an area that will be page-locked is cut into
    chunks (the largest half the area), so this one is one piece and the tensor is lent,
    not copied."""
    sender, receiver = open_channel(FORK, capacity_items=4, capacity_bytes=64 << 20)
    try:
        tensor = torch.full((40 << 20,), 3.0)  # 160 MiB
        assert tensor.nbytes > receiver._lent._region.lend_size // 2
        before = lending()
        # Lent, the frame holds only where the bytes lie; copied, it would be streamed
        # through the ring, which needs this thread reading: a producer thread sends.
        producer = threading.Thread(target=sender.send, args=(tensor,))
        producer.start()
        got = receiver.recv(timeout=30)
        producer.join(30)
        during = lending()
        assert during.lent == before.lent + 1 and during.copied == before.copied
        assert during.held_bytes == before.held_bytes + tensor.nbytes  # the user holds the area's bytes
        assert torch.equal(got, tensor)
        del got
        assert lending().held_bytes == before.held_bytes
        assert sender.lent_extents() == 0  # back to the sender once dropped
    finally:
        sender.close()
        receiver.close()


def test_a_view_outlives_its_channel():
    sender, receiver = open_channel(FORK, capacity_items=4, capacity_bytes=RING)
    gc.collect()
    before = lending()
    sender.send(filled(11))
    item = receiver.recv()
    sender.close()
    receiver.close()
    gc.collect()
    assert (item == 11).all()  # the mapping stays while a view needs it
    item[:] = 1  # and stays writable
    del item
    assert lending().held_bytes == before.held_bytes


def test_a_sender_out_of_slots_sends_copies_and_says_so(monkeypatch):
    """With every slot lent to a user who keeps the items, the sender puts the next
    buffers in the ring instead of waiting for the user: they arrive (as copies) and are
    counted as copied."""
    monkeypatch.setattr(_lend, "SLOTS", 4)
    sender, receiver = open_channel(FORK, capacity_items=64, capacity_bytes=RING)
    try:
        before = lending()
        kept = []
        for i in range(10):
            sender.send(filled(i))
            kept.append(receiver.recv())
        after = lending()
        assert [int(a[0]) for a in kept] == list(range(10))
        assert after.lent - before.lent == 4 and after.copied - before.copied == 6
        assert all(backed_by_shared_memory(a) for a in kept[:4]) and not any(backed_by_shared_memory(a) for a in kept[4:])
    finally:
        sender.close()
        receiver.close()


def test_a_forked_child_never_gives_back_what_its_parent_holds(channel):
    """A process holding lent items forks (a new loader's workers, say). The child's
    copies of those items are the parent's to give back: if the child gave an extent
    back, the sender would reuse it under the parent's item."""
    sender, receiver = channel
    sender.send(filled(0))
    held = receiver.recv()
    child = FORK.Process(target=drop_inherited_lent_buffers)
    child.start()
    child.join(30)
    assert child.exitcode == 0
    for i in range(1, 3 * _lend.LEND_FACTOR * RING // ITEM):
        sender.send(filled(i))
        assert (receiver.recv() == i % 251).all()
    assert (held == 0).all()


@shm_only  # the slots' states in the ring's control page
def test_an_endpoint_that_finds_buffers_lent_by_an_earlier_owner_does_not_lend(channel):
    """It cannot know which extents those buffers hold, so it copies instead of risking
    lending one of them again."""
    sender, receiver = channel
    sender.send(filled(1))
    held = receiver.recv()
    successor = _lend.LendArea(sender._region.ctl, sender._region.lend)
    assert successor.reserve([memoryview(filled(2))]) is None
    del held
    assert _lend.LendArea(sender._region.ctl, sender._region.lend).reserve([memoryview(filled(2))]) is not None
