"""The device feed's CUDA rules, checked without a device: a fake of ``feeding.CudaCalls``
keeps what CUDA keeps (each thread's current device and last error, each device's current
stream, which events the device has passed, which streams capture) and records which
device each call ran on.

What a user with a GPU relies on, each forced here through its path:

* ``device="cuda"`` (no index) marks every tensor it hands out as used by the loop's stream,
  so a batch dropped at once is never overwritten by the next copy while a kernel reads it;
* a registration the device refuses leaves no CUDA error behind on the loop's thread (its
  next kernel would raise it), warns once with CUDA's own words, and items arrive intact;
* page-locking and the release fence use the device the items are for, not whichever one
  the thread that happens to take them has current;
* a buffer dropped while a copy from any view of it (at any offset) may still run goes back
  only once the device has passed it, and a fence that could not be recorded or asked
  (a CUDA graph being captured, a failing call) never counts as passed;
* what loaders made one after another leave locked does not add up.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import sys
import threading
import weakref
from typing import Any

import numpy as np
import pytest
import torch

from mprs_plus.runtime.main import feeding
from mprs_plus.runtime.main.feeding import CudaMover, CudaPageLocker, FeedCounters, feed_ahead
from mprs_plus.transport import TRANSPORT, _lend, lending, open_channel

shm_only = pytest.mark.skipif(TRANSPORT != "shm", reason="lend areas are the shared-memory transport's")

FORK = multiprocessing.get_context("fork")
ITEM = 256 << 10  # lent (>= LEND_MIN)
NOT_SUPPORTED = 801  # cudaErrorNotSupported


class FakeStream:
    def __init__(self, fake: FakeCuda, device: int, name: str) -> None:
        self.fake, self.device, self.name = fake, device, name
        self.waited: list[FakeEvent] = []

    def wait_event(self, event: FakeEvent) -> None:
        self.waited.append(event)

    def __repr__(self) -> str:
        return f"<stream {self.name} on cuda:{self.device}>"


class FakeEvent:
    """Passes once the test finishes the work of the device it was recorded on."""

    def __init__(self, fake: FakeCuda) -> None:
        self.fake = fake
        self.device: int | None = None
        self.serial = 0

    def record(self, stream: FakeStream | None = None) -> None:
        fake = self.fake
        hook, fake.on_record = fake.on_record, None
        if hook is not None:
            hook()  # what runs inside a device call: a finalizer, or another thread's reaper
        stream = stream if stream is not None else fake.current_stream(None)
        if fake.fail_record:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if stream.device in fake.capturing_on:
            fake.recorded_while_capturing += 1  # a node of the graph, never an event that passes
        fake.unsafe("record")
        fake.calls.append(("record", stream.device, threading.get_ident()))
        fake.work[stream.device] = fake.work.get(stream.device, 0) + 1
        self.device, self.serial = stream.device, fake.work[stream.device]

    def query(self) -> bool:
        fake = self.fake
        if fake.capturing_on:
            fake.queried_while_capturing += 1  # in CUDA this invalidates the capture
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        if fake.fail_query:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        fake.unsafe("query")
        fake.queries += 1
        assert self.device is not None, "queried before it was recorded"
        return fake.finished.get(self.device, 0) >= self.serial


class FakeCuda:
    """The methods of ``feeding.CudaCalls``, with CUDA's per-thread state: a thread starts
    on device 0 with no error; a refused call leaves its error for the thread's next
    kernel; using a device gives it a context."""

    def __init__(self, refuse: tuple[str, ...] = ()) -> None:
        self._local = threading.local()
        self.refuse = set(refuse)
        self.calls: list[tuple[str, int, int]] = []  # (call, device it ran on, thread)
        self.contexts: set[int] = set()
        self.capturing_on: set[int] = set()
        self.fail_record = self.fail_query = False
        self.recorded_while_capturing = self.queried_while_capturing = 0
        self.work: dict[int, int] = {}  # device -> events recorded on it so far
        self.finished: dict[int, int] = {}  # device -> events it has passed
        self.pinned: list[weakref.ref[torch.Tensor]] = []
        self.recorded_streams: list[tuple[torch.Tensor, FakeStream]] = []
        self.on_record: Any = None
        self.defaults: dict[int, FakeStream] = {}
        self.asked: list[str] = []  # device questions (each initialises CUDA in torch)
        self.queries = 0
        # Threads that capture a graph in CUDA's global mode (torch.cuda.graph's default),
        # and the calls other threads made meanwhile without relaxing their own mode:
        # each of them would have invalidated that capture.
        self.capturing_globally: set[int] = set()
        self.broke_capture: list[tuple[str, int]] = []

    # -- state a test sets or reads ------------------------------------------------------
    def last_error(self) -> int:
        """This thread's pending error (what its next kernel launch would raise)."""
        return getattr(self._local, "error", 0)

    def finish(self, device: int | None = None) -> None:
        for index, recorded in self.work.items():
            if device is None or index == device:
                self.finished[index] = recorded

    def devices_called(self, name: str) -> list[int]:
        return [device for call, device, _ in self.calls if call == name]

    # -- CudaCalls ------------------------------------------------------------------------
    def _device(self) -> int:
        return getattr(self._local, "device", 0)

    def unsafe(self, name: str) -> None:
        """A call CUDA prohibits in a thread of global mode while another thread captures."""
        me = threading.get_ident()
        if self.capturing_globally - {me} and not getattr(self._local, "relaxed", 0):
            self.broke_capture.append((name, me))

    @contextlib.contextmanager
    def relaxed(self):
        self._local.relaxed = getattr(self._local, "relaxed", 0) + 1
        try:
            yield
        finally:
            self._local.relaxed -= 1

    def _use(self, name: str) -> int:
        self.unsafe(name)
        device = self._device()
        self.contexts.add(device)
        self.calls.append((name, device, threading.get_ident()))
        return device

    def _refused(self, name: str) -> tuple[int, str]:
        if name in self.refuse:
            self._local.error = NOT_SUPPORTED
            return NOT_SUPPORTED, "operation not supported"
        return 0, ""

    def host_register(self, address: int, nbytes: int, flags: int) -> tuple[int, str]:
        self._use("register")
        return self._refused("register")

    def host_unregister(self, address: int) -> tuple[int, str]:
        self._use("unregister")
        return self._refused("unregister")

    def available(self) -> bool:
        return True

    def current_device(self) -> int:
        self.asked.append("current_device")  # torch initialises CUDA for it
        return self._device()

    def set_device(self, index: int) -> None:
        self.asked.append("set_device")
        self._local.device = index
        self.contexts.add(index)

    @contextlib.contextmanager
    def device(self, index: int):
        before = self._device()
        self._local.device = index
        try:
            yield
        finally:
            self._local.device = before

    def devices_with_context(self) -> list[int]:
        self.asked.append("devices_with_context")
        return sorted(self.contexts)

    def capturing(self, index: int) -> bool:
        return index in self.capturing_on

    def new_stream(self, index) -> FakeStream:
        device = self._index(index)
        self.contexts.add(device)
        return FakeStream(self, device, "side")

    def _index(self, index) -> int:
        if isinstance(index, torch.device):
            index = index.index
        return self._device() if index is None else int(index)

    def _streams(self) -> dict[int, FakeStream]:
        if not hasattr(self._local, "streams"):
            self._local.streams = {}
        return self._local.streams

    def current_stream(self, index) -> FakeStream:
        device = self._index(index)
        current = self._streams().get(device)
        if current is None:  # the device's default stream, the same for every thread
            current = self.defaults.setdefault(device, FakeStream(self, device, "default"))
        return current

    @contextlib.contextmanager
    def stream_context(self, stream: FakeStream):
        streams = self._streams()
        before_device, before_stream = self._device(), streams.get(stream.device)
        self._local.device, streams[stream.device] = stream.device, stream  # torch.cuda.stream: its device too
        try:
            yield
        finally:
            self._local.device = before_device
            if before_stream is None:
                streams.pop(stream.device, None)
            else:
                streams[stream.device] = before_stream

    def new_event(self) -> FakeEvent:
        return FakeEvent(self)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        self._use("pinned_empty")
        block = torch.zeros(nbytes, dtype=torch.uint8)
        self.pinned.append(weakref.ref(block))
        return block


class FakeTensor(torch.Tensor):
    """A CPU tensor that says it lives where the test says, moves as torch would resolve
    the device (``"cuda"``: the current device), and records ``record_stream``."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def of(data: torch.Tensor, where: torch.device, fake: FakeCuda) -> FakeTensor:
        tensor = torch.Tensor._make_subclass(FakeTensor, data)
        tensor.where, tensor.fake = where, fake
        return tensor

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.where

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return self.where.type == "cuda"

    def is_pinned(self, *args) -> bool:  # type: ignore[override]
        return True  # a lent, registered tensor

    def to(self, device, non_blocking: bool = False) -> FakeTensor:  # type: ignore[override]
        target = torch.device(device)
        if target.index is None:
            target = torch.device(target.type, self.fake.current_device())
        self.fake.unsafe("copy")  # an allocation from the caching allocator, a copy
        return FakeTensor.of(self.as_subclass(torch.Tensor).clone(), target, self.fake)

    def record_stream(self, stream: FakeStream) -> None:  # type: ignore[override]
        self.fake.recorded_streams.append((self, stream))


def host_item(index: int, fake: FakeCuda) -> dict:
    cpu = torch.device("cpu")
    return {"x": FakeTensor.of(torch.full((4,), index), cpu, fake), "y": [FakeTensor.of(torch.ones(2), cpu, fake)]}


@pytest.fixture
def fake(monkeypatch):
    """A fake device behind the feeding's seam, as ``open_feeding`` builds it."""
    device = FakeCuda()
    monkeypatch.setattr(feeding, "CudaCalls", lambda: device)
    monkeypatch.setattr(feeding, "_the_locker", None)  # the process's locker, made afresh for this fake
    yield device
    _lend.lock_pages_with(None)
    device.capturing_on.clear()
    device.fail_record = device.fail_query = False
    device.finish()  # whatever still waits goes back, so that the next test starts clean
    gc.collect()
    assert lending().awaiting_device == 0


def open_feed(*args):
    """``open_feeding`` as a loader calls it, armed as at its first item (after the fork)."""
    feed = feeding.open_feeding(*args)
    feed.arm()
    return feed


@pytest.fixture
def channel():
    with _lend.pinning_receivers():  # as a pinning loader makes its channels
        sender, receiver = open_channel(FORK, capacity_items=64, capacity_bytes=1 << 20)
    yield sender, receiver
    sender.close()
    receiver.close()


def slots_lent(receiver) -> int:
    ctl = receiver._lent.ctl
    return sum(1 for slot in range(_lend.SLOTS) if ctl[_lend.SLOT_BASE + slot] != _lend.FREE)


def lend_one(channel, value: int = 7) -> np.ndarray:
    sender, receiver = channel
    sender.send(np.full(ITEM, value, dtype=np.uint8))
    return receiver.recv(timeout=5)


# -- 1. device="cuda" without an index --------------------------------------------------------


@pytest.mark.parametrize("current", [0, 1])
def test_device_cuda_without_an_index_marks_every_tensor_for_the_loops_stream(current):
    fake = FakeCuda()
    fake.set_device(current)
    mover = CudaMover("cuda", FeedCounters(), calls=fake)
    handed = list(feed_ahead(iter([host_item(i, fake) for i in range(4)]), mover, 2, FeedCounters()))
    tensors = [t for item in handed for t in (item["x"], *item["y"])]
    assert {t.device for t in tensors} == {torch.device("cuda", current)}  # where torch resolves "cuda"
    marked = {id(t): s for t, s in fake.recorded_streams}
    assert all(id(t) in marked for t in tensors), "a tensor handed out was not marked used by the loop's stream"
    # The loop's own (current) stream on that device, never the side stream of the copies.
    assert all(s.device == current and s.name == "default" for s in marked.values())


class OwnDeviceBatch:
    """A batch type with its own pin_memory() and to(), as many libraries' batches have."""

    def __init__(self, data: FakeTensor, pinned: bool = False, where: str = "cpu", thread: int = 0) -> None:
        self.data, self.pinned, self.where, self.thread = data, pinned, where, thread
        self.stream: FakeStream | None = None

    def pin_memory(self) -> OwnDeviceBatch:
        return OwnDeviceBatch(self.data, pinned=True)

    def to(self, device, non_blocking: bool = False) -> OwnDeviceBatch:
        moved = OwnDeviceBatch(self.data.to(device, non_blocking=non_blocking), self.pinned, str(device))
        moved.stream = self.data.fake.current_stream(torch.device(device).index)
        return moved


def test_a_batch_types_own_object_is_pinned_by_it_and_moved_by_it_on_the_loops_stream():
    """device=: the service cannot mark the tensors inside such an object as used by the
    loop's stream, so it moves it there, with the object's own to(), when handing it out."""
    fake = FakeCuda()
    mover = CudaMover("cuda:0", FeedCounters(), calls=fake)
    items = [{"own": OwnDeviceBatch(FakeTensor.of(torch.full((4,), i), torch.device("cpu"), fake)), "i": i} for i in range(3)]
    handed = list(feed_ahead(iter(items), mover, 2, FeedCounters()))
    assert [item["i"] for item in handed] == [0, 1, 2]
    assert all(item["own"].pinned and item["own"].where == "cuda:0" for item in handed)
    assert all(item["own"].stream.name == "default" for item in handed)  # the loop's stream, not the side one


# -- 2. a refused registration ---------------------------------------------------------------


def test_a_refused_registration_leaves_no_cuda_error_and_warns_once_with_cudas_words():
    fake = FakeCuda(refuse=("register",))
    locker = CudaPageLocker(calls=fake)
    with pytest.warns(RuntimeWarning, match="operation not supported") as caught:
        assert locker.register(4096, 64 << 20) is False
        assert locker.register(8192, 64 << 20) is False
    assert len(caught) == 1
    assert "ulimit" not in str(caught[0].message)  # registration is not bounded by it (docs/gpu.md)
    # The loop's next kernel launch would raise CUDA's pending error of this thread.
    assert fake.last_error() == 0


def test_a_refused_unregistration_leaves_no_cuda_error_either():
    fake = FakeCuda(refuse=("unregister",))
    locker = CudaPageLocker(calls=fake)
    assert locker.register(4096, 64 << 20) is True
    locker.unregister(4096)
    assert fake.devices_called("unregister") != []
    assert fake.last_error() == 0


@shm_only
def test_items_arrive_intact_and_unlocked_when_the_device_refuses(fake, channel):
    fake.refuse.add("register")
    feed = open_feed(True, None, 2)
    got: list[np.ndarray] = []
    try:
        with pytest.warns(RuntimeWarning, match="refused"):
            got = [lend_one(channel, value) for value in range(5)]
        assert [int(a[0]) for a in got] == list(range(5))
        assert all(bool((a == a[0]).all()) for a in got)
        assert channel[1]._lent.locker is None  # lent as plain memory; the feed pins copies
        assert fake.last_error() == 0
    finally:
        del got
        feed.close()


# -- 3. the device of the items, not of the thread --------------------------------------------


@shm_only
def test_pin_memory_alone_registers_on_the_device_current_when_the_loader_starts(fake, channel):
    fake.set_device(1)  # torch.cuda.set_device(rank) before iter(loader)
    feed = open_feed(True, None, 2)
    try:
        fake.set_device(0)  # whatever the thread that takes items has current later
        item = lend_one(channel)
        assert fake.devices_called("register") == [1]
        del item
    finally:
        feed.close()


@shm_only
def test_an_existing_context_is_used_rather_than_a_new_one_on_the_current_device(fake, channel):
    """A rank that moved its model to cuda:1 without set_device: no context on GPU 0."""
    fake.contexts.add(1)
    feed = open_feed(True, None, 2)
    try:
        item = lend_one(channel)
        assert fake.devices_called("register") == [1]
        assert fake.contexts == {1}
        del item
    finally:
        feed.close()


@shm_only
def test_device_given_registers_there_whatever_is_current(fake, channel):
    feed = open_feed(True, "cuda:1", 2)
    try:
        item = lend_one(channel)
        assert fake.devices_called("register") == [1]
        assert 0 not in fake.contexts
        del item
    finally:
        feed.close()


@shm_only
def test_a_buffer_copied_to_another_device_goes_back_only_once_that_device_passed_it(fake, channel):
    """pin_memory=True alone, current device 0, the loop copies to cuda:1 (its
    ``.to(f"cuda:{rank}", non_blocking=True)``) and drops the host tensor at once."""
    feed = open_feed(True, None, 2)
    try:
        fake.contexts.update({0, 1})
        item = lend_one(channel)
        fake.work[1] = fake.work.get(1, 0) + 1  # the copy, enqueued on cuda:1's current stream
        del item
        gc.collect()
        fake.finish(0)  # the current device is idle...
        assert lending().awaiting_device == 1  # ...but cuda:1 may still read the extent
        assert slots_lent(channel[1]) == 1
        fake.finish(1)
        assert lending().awaiting_device == 0
        assert slots_lent(channel[1]) == 0
    finally:
        feed.close()


# -- also settled: offset views, graph capture, what is left locked ---------------------------


@shm_only
def test_a_lent_buffer_viewed_at_an_offset_goes_back_only_after_the_views_copy(fake, channel):
    feed = open_feed(True, None, 2)
    try:
        item = lend_one(channel)
        view = torch.from_numpy(item)[4096:]  # the copy reads from here, not from the start
        del item
        gc.collect()
        assert slots_lent(channel[1]) == 1 and lending().awaiting_device == 0  # the view holds it
        del view
        gc.collect()
        assert lending().awaiting_device == 1 and slots_lent(channel[1]) == 1
        fake.finish()
        assert lending().awaiting_device == 0 and slots_lent(channel[1]) == 0
    finally:
        feed.close()


def test_a_pinned_copy_viewed_at_an_offset_is_kept_from_torchs_allocator_until_its_copy_passed():
    """torch's pinned allocator records a copy's event only for its block's start pointer:
    a copy from an offset view of a copied-out buffer would let the block be reused early."""
    fake = FakeCuda()
    locker = CudaPageLocker(calls=fake)
    fake.contexts.add(0)
    out = locker.allocate(ITEM)
    (block,) = fake.pinned
    view = torch.from_numpy(out)[4096:]
    del out
    gc.collect()
    fake.work[0] = fake.work.get(0, 0) + 1  # a non-blocking copy from the view, on the current stream
    del view
    gc.collect()
    assert block() is not None, "the block went back to torch's allocator while its copy may still read it"
    fake.finish()
    locker.allocate(16)  # the next allocation looks
    gc.collect()
    assert block() is None


def test_a_pinned_copy_dropped_while_the_copies_are_reaped_is_kept_until_its_fence_passes():
    """Making the fence of a dropped copy runs device calls; another thread (or a
    finalizer) may reap the waiting copies in that window. The copy must not go back to
    torch's allocator before its own fence passed."""
    fake = FakeCuda()
    locker = CudaPageLocker(calls=fake)
    fake.contexts.add(0)
    first, second = locker.allocate(ITEM), locker.allocate(ITEM)
    blocks = list(fake.pinned)
    fake.work[0] = fake.work.get(0, 0) + 1  # copies from both, still running
    del first
    gc.collect()
    fake.on_record = locker._reap_copies
    del second
    gc.collect()
    assert all(block() is not None for block in blocks), "a pinned block went back while a copy may read it"
    assert locker.copies_waiting == 2
    fake.finish()
    assert locker.copies_waiting == 0
    gc.collect()
    assert all(block() is None for block in blocks)


@shm_only
@pytest.mark.parametrize("failure", ["capturing", "record_fails", "query_fails"])
def test_a_fence_that_could_not_be_recorded_or_asked_never_counts_as_passed(fake, channel, failure):
    feed = open_feed(True, None, 2)
    try:
        item = lend_one(channel)
        if failure == "capturing":
            fake.capturing_on.add(0)
        elif failure == "record_fails":
            fake.fail_record = True
        else:
            fake.fail_query = True
        del item
        gc.collect()
        fake.finish()
        assert lending().awaiting_device == 1
        assert slots_lent(channel[1]) == 1
        assert fake.recorded_while_capturing == 0 and fake.queried_while_capturing == 0
        fake.capturing_on.clear()
        fake.fail_record = fake.fail_query = False
        lending()  # recorded now, if it could not be before
        fake.finish()
        assert lending().awaiting_device == 0
        assert slots_lent(channel[1]) == 0
    finally:
        feed.close()


@shm_only
def test_loaders_made_one_after_another_do_not_accumulate_locked_memory(fake, monkeypatch):
    """Each loader ends with a buffer its device has not passed yet (its fence waits past
    the close's bounded wait); once passed, the next loader's start gives the area back."""
    monkeypatch.setattr(feeding, "SETTLE", 0.05)
    for epoch in range(4):
        feed = open_feed(True, None, 2)
        with _lend.pinning_receivers():
            sender, receiver = open_channel(FORK, capacity_items=8, capacity_bytes=1 << 20)
        item = lend_one((sender, receiver), epoch)
        fake.work[0] = fake.work.get(0, 0) + 1  # a copy still running
        del item
        sender.close()
        receiver.close()
        feed.close()  # bounded: the fence has not passed
        assert lending().awaiting_device == 1
        locked = len(fake.devices_called("register")) - len(fake.devices_called("unregister"))
        assert locked <= 1, f"epoch {epoch}: {locked} lend areas still locked"
        fake.finish()  # the device passes it after the loader is gone
    open_feed(True, None, 2).close()
    assert lending().awaiting_device == 0
    assert len(fake.devices_called("register")) == len(fake.devices_called("unregister")) == 4


@shm_only
def test_a_look_asks_the_device_once_per_stream_however_many_fences_wait(fake, channel):
    """Events on one stream pass in order: the first one not passed holds the later ones
    back, and asking about them costs a query each for nothing."""
    feed = open_feed(True, None, 2)
    try:
        items = [lend_one(channel, value) for value in range(6)]
        fake.work[0] = fake.work.get(0, 0) + 1  # a copy still running before the drops
        del items
        gc.collect()
        assert lending().awaiting_device == 6
        before = fake.queries
        assert lending().awaiting_device == 6
        assert fake.queries - before == 1
        fake.finish()
        assert lending().awaiting_device == 0
        assert slots_lent(channel[1]) == 0
    finally:
        feed.close()


def test_a_fence_on_another_stream_is_not_held_back_by_one_that_has_not_passed():
    fake = FakeCuda()
    locker = CudaPageLocker(calls=fake)
    fake.contexts.add(0)
    side = FakeStream(fake, 0, "side")
    first = locker.fence()  # on the default stream
    with fake.stream_context(side):
        fake.work[0] = fake.work.get(0, 0) + 1
        second = locker.fence()  # on the side stream
    fake.finished[0] = second.events[0][2].serial  # the side stream's work is done...
    first.events[0][2].serial = second.events[0][2].serial + 1  # ...the default stream's not
    blocked: set = set()
    assert locker.passed(first, blocked) is False
    assert locker.passed(second, blocked) is True


# -- the feeding's life: CUDA after the fork, one close, only its own channels -----------------


def test_a_feeding_closed_twice_leaves_another_loaders_pinning_on(fake):
    """A loader's finalizer and its stop() both close its feeding: the second close must
    not take the page-locking away from another loader that still runs."""
    first, second = open_feed(True, None, 2), open_feed(True, None, 2)
    first.close()
    first.close()
    assert _lend._locker is not None, "the other loader's channels would no longer be page-locked"
    second.close()
    assert _lend._locker is None


@shm_only
def test_a_loader_that_did_not_ask_for_pinning_is_neither_registered_nor_fenced(fake):
    feed = open_feed(True, None, 2)
    sender, receiver = open_channel(FORK, capacity_items=8, capacity_bytes=1 << 20)  # another loader's
    try:
        item = lend_one((sender, receiver))
        del item
        gc.collect()
        assert fake.devices_called("register") == []
        assert lending().awaiting_device == 0  # given back at once, no fence
        assert slots_lent(receiver) == 0
    finally:
        sender.close()
        receiver.close()
        feed.close()


@shm_only
def test_pin_memory_device_names_the_device_registered_for(fake, channel):
    feed = open_feed(True, None, 2, "cuda:1")
    try:
        item = lend_one(channel)
        assert set(fake.devices_called("register")) == {1}
        del item
    finally:
        feed.close()


WORKERS_SEE: FakeCuda | None = None  # the fake device, as a forked worker inherits it


class DeviceQuestionsAtFork(torch.utils.data.Dataset):
    """Each item: how many questions the main process had asked the device when the
    worker was forked."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> int:
        return len(WORKERS_SEE.asked)


def test_no_cuda_call_is_made_before_the_workers_fork(fake, monkeypatch):
    """torch's DataLoader forks its workers before it asks for the current device: a
    process whose CUDA is initialised leaves forked children unable to use it."""
    import mprs_plus

    monkeypatch.setattr(sys.modules[__name__], "WORKERS_SEE", fake)
    loader = mprs_plus.DataLoader(
        DeviceQuestionsAtFork(), batch_size=None, num_workers=2, multiprocessing_context="fork", pin_memory=True
    )
    assert fake.asked == []  # making the iterator asks nothing yet
    got = list(loader)
    assert got == [0, 0]
    assert "current_device" in fake.asked or "devices_with_context" in fake.asked  # asked after the fork


# -- a graph captured on another thread -------------------------------------------------------


@shm_only
@pytest.mark.parametrize("mode", ["pin_memory", "device"])
def test_a_graph_captured_on_another_thread_is_not_broken_by_the_feeding(fake, channel, mode):
    """The loop's thread captures a CUDA graph (global mode, torch.cuda.graph's default)
    while another thread (torchdata's pin_memory() prefetcher, a loop's helper) takes
    items: the first lend's registration, the fences and their queries, a pinned copy,
    and the device feed's copies must all leave the capture valid."""
    feed = open_feed(True, "cuda:0" if mode == "device" else None, 2)
    fake.capturing_globally.add(threading.get_ident())  # this thread captures from now on
    errors: list[BaseException] = []

    def items():
        sender, receiver = channel
        for value in range(4):
            sender.send(np.full(ITEM, value, dtype=np.uint8))
            yield FakeTensor.of(torch.from_numpy(receiver.recv(timeout=5)), torch.device("cpu"), fake)

    def take() -> None:
        try:
            for item in feed.iterate(items()):
                del item  # dropped at once: a fence, then queries at the next look
            lending()
            feeding._the_locker.allocate(ITEM)  # a copy into pinned memory, dropped at once
        except BaseException as exc:  # raised in the test's thread below
            errors.append(exc)

    try:
        taker = threading.Thread(target=take)
        taker.start()
        taker.join(timeout=30)
        assert not taker.is_alive() and errors == []
        assert set(fake.devices_called("register")) == {0}
        assert any(call == "record" for call, _, thread in fake.calls if thread != threading.get_ident())
        assert fake.broke_capture == [], "a call of the feeding's thread invalidated the capture"
    finally:
        fake.capturing_globally.clear()
        fake.finish()
        gc.collect()
        feed.close()


class FailingLocker:
    """A page-locker whose fences fail to be made or asked until the test says otherwise."""

    def __init__(self) -> None:
        self.fence_fails = self.passed_fails = True
        self.done = False

    def register(self, address, nbytes):
        return True

    def unregister(self, address):
        pass

    def fence(self):
        if self.fence_fails:
            raise RuntimeError("the device failed to record")
        return "fence"

    def passed(self, token, blocked):
        if self.passed_fails:
            raise RuntimeError("the device failed to answer")
        return token == "fence" and self.done

    def allocate(self, nbytes):
        return bytearray(nbytes)


@shm_only
def test_the_transport_never_takes_a_failed_fence_for_a_passed_one(channel):
    locker = FailingLocker()
    _lend.lock_pages_with(locker)
    try:
        item = lend_one(channel)
        del item
        gc.collect()
        assert lending().awaiting_device == 1  # its fence could not be made
        locker.fence_fails = False
        assert lending().awaiting_device == 1  # made now; asking it fails
        locker.passed_fails = False
        assert lending().awaiting_device == 1  # asked: not passed yet
        locker.done = True
        assert lending().awaiting_device == 0
        assert slots_lent(channel[1]) == 0
    finally:
        _lend.lock_pages_with(None)
        locker.fence_fails = locker.passed_fails = False
        locker.done = True
        lending()
