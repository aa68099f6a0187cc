"""pin_memory=True and device= without an accelerator: the run-ahead, order, errors,
checkpoints and statistics of the device feed, through a fake mover that stands in for
the device; and what a user without CUDA sees (a warning, items as they are)."""

from __future__ import annotations

import contextlib
import traceback
from collections import defaultdict, namedtuple
from collections.abc import Mapping

import pytest
import torch
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

import pipelines
from mprs_plus import MultiProcessingReadingService
from mprs_plus.runtime.main import feeding
from mprs_plus.runtime.main.feeding import FeedCounters, Feeding, feed_ahead, map_tensors

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


class FakeMover:
    """Stands in for the device: 'moving' an item tags it; records what happened when."""

    def __init__(self, device: str = "fake", counters: FeedCounters | None = None) -> None:
        self.on_side = False
        self.events: list[tuple[str, object]] = []
        self.started = 0

    @contextlib.contextmanager
    def side(self):
        self.on_side = True
        try:
            yield
        finally:
            self.on_side = False

    def start(self, box):
        item = box.pop()
        assert not box, "the mover must take the item out of the box"
        self.events.append(("start", item))
        self.started += 1
        return ("moved", item), self.started

    def hand_out(self, moved, token):
        self.events.append(("hand_out", moved[1]))
        return moved, token % 2 == 0


def counting_source(n: int, mover: FakeMover, pulled: list[int], fail_at: int | None = None):
    for i in range(n):
        assert mover.on_side, "the source must be pulled while the side stream is current"
        if i == fail_at:
            raise ValueError(f"bad item {i}")
        pulled.append(i)
        yield i


@pytest.mark.parametrize("ahead", [1, 2, 5])
def test_the_feed_runs_at_most_ahead_items_ahead_of_the_loop_in_order(ahead):
    mover, pulled, counters = FakeMover(), [], FeedCounters(device="fake")
    stream = feed_ahead(counting_source(10, mover, pulled), mover, ahead, counters)
    got = []
    for moved in stream:
        assert not mover.on_side, "the loop must never run with the side stream current"
        got.append(moved[1])
        # Enqueued but not handed out: never more than ``ahead``, the one in hand included.
        assert len(pulled) - (len(got) - 1) <= ahead
    assert got == list(range(10))
    assert counters.items == 10
    assert [e for e, _ in mover.events].count("start") == 10


def test_the_first_item_waits_for_no_more_than_ahead_pulls():
    mover, pulled = FakeMover(), []
    stream = feed_ahead(counting_source(100, mover, pulled), mover, 3, FeedCounters())
    assert next(stream)[1] == 0
    assert pulled == [0, 1, 2]


def test_an_error_comes_after_the_items_before_it_with_its_own_traceback():
    mover, pulled = FakeMover(), []
    stream = feed_ahead(counting_source(10, mover, pulled, fail_at=4), mover, 3, FeedCounters())
    got = []
    with pytest.raises(ValueError, match="bad item 4") as raised:
        for moved in stream:
            got.append(moved[1])
    assert got == [0, 1, 2, 3]
    frames = [frame.name for frame in traceback.extract_tb(raised.value.__traceback__)]
    assert "counting_source" in frames


def test_items_handed_out_before_their_copy_finished_are_counted():
    mover, counters = FakeMover(), FeedCounters()
    list(feed_ahead(counting_source(6, mover, []), mover, 2, counters))
    assert counters.waited_on_copy == 3  # the fake's even tokens are 'still running'


def test_map_tensors_reaches_every_tensor_and_keeps_the_structure():
    Pair = namedtuple("Pair", "a b")
    item = {"x": torch.zeros(2), "rest": [Pair(torch.ones(1), "label"), (torch.ones(3), 7)], "n": 3}
    out = map_tensors(item, lambda t: t + 1)
    assert isinstance(out["rest"][0], Pair) and out["rest"][0].b == "label"
    assert out["x"].tolist() == [1.0, 1.0]
    assert out["rest"][1][0].tolist() == [2.0, 2.0, 2.0] and out["rest"][1][1] == 7
    assert out["n"] == 3


class Labelled(list):
    """A custom batch list with an attribute of its own."""

    label = ""


class Frozen(Mapping):
    """An immutable mapping built from a dict."""

    def __init__(self, data):
        self._data = dict(data)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)


class OwnBatch:
    """A batch type with its own pin_memory(), as torch's DataLoader documents them."""

    def __init__(self, data: torch.Tensor, pinned: bool = False) -> None:
        self.data, self.pinned = data, pinned

    def pin_memory(self) -> "OwnBatch":
        return OwnBatch(self.data, pinned=True)


def test_map_tensors_keeps_custom_mappings_and_sequences_as_torchs_pin_memory_loop_does():
    counts = defaultdict(list, {"a": torch.zeros(1)})
    labelled = Labelled([torch.zeros(1), torch.ones(1)])
    labelled.label = "kept"
    item = {"counts": counts, "labelled": labelled, "frozen": Frozen({"t": torch.zeros(2)}), "text": "ab"}
    out = map_tensors(item, lambda t: t + 1)
    assert isinstance(out["counts"], defaultdict) and out["counts"].default_factory is list
    assert out["counts"]["a"].tolist() == [1.0] and out["counts"]["missing"] == []
    assert type(out["labelled"]) is Labelled and out["labelled"].label == "kept"
    assert [t.item() for t in out["labelled"]] == [1.0, 2.0]
    assert type(out["frozen"]) is Frozen and out["frozen"]["t"].tolist() == [1.0, 1.0]
    assert out["text"] == "ab"
    assert counts["a"].tolist() == [0.0] and labelled[0].item() == 0.0  # the input is left as it was


def test_pin_memory_calls_a_batch_types_own_pin_memory():
    """As torch's pin-memory loop: an object with pin_memory() is pinned by it, also
    inside containers."""
    from mprs_plus.runtime.main.feeding import pin_each

    items = [OwnBatch(torch.zeros(2)), {"batch": OwnBatch(torch.ones(2)), "x": 1}]
    out = list(pin_each(iter(items), FeedCounters()))
    assert out[0].pinned and out[1]["batch"].pinned and out[1]["x"] == 1


def huge_tensor(i: int) -> torch.Tensor:
    return torch.full((1 << 20,), i, dtype=torch.float32)  # 4 MiB


def big_tensor(i: int) -> torch.Tensor:
    return torch.full((64 << 10,), i, dtype=torch.float32)  # 256 KiB: lent


@needs_no_cuda
def test_pin_memory_without_an_accelerator_warns_and_delivers_every_item():
    service = MultiProcessingReadingService(2, pin_memory=True)
    loader = DataLoader2(IterableWrapper(range(8)).sharding_filter().map(big_tensor), reading_service=service)
    try:
        with pytest.warns(UserWarning, match="no accelerator is available"):
            iterator = iter(loader)  # DataLoader2 starts the service here
        got = [int(t[0]) for t in iterator]
    finally:
        loader.shutdown()
    assert got == list(range(8))


@needs_no_cuda
def test_device_without_cuda_is_an_error_that_says_what_to_do():
    service = MultiProcessingReadingService(2, pin_memory=True, device="cuda")
    loader = DataLoader2(IterableWrapper(range(4)).sharding_filter(), reading_service=service)
    try:
        with pytest.raises(RuntimeError, match="CUDA is not available.*Leave device=None"):
            iter(loader)
    finally:
        loader.shutdown()


@pytest.fixture
def fake_device(monkeypatch):
    """The service's feeding with the fake mover: the runtime's real wiring, no device."""
    made: list[Feeding] = []

    def open_fake(pin_memory, device, ahead):
        made.append(Feeding(device, ahead, mover_factory=FakeMover))
        return made[-1]

    monkeypatch.setattr(feeding, "open_feeding", open_fake)
    return made


def test_a_fed_service_delivers_every_item_in_order_and_reports_it(fake_device):
    service = MultiProcessingReadingService(2, pin_memory=True, device="cuda", device_prefetch=3)
    loader = DataLoader2(IterableWrapper(range(20)).sharding_filter().map(pipelines.identity), reading_service=service)
    try:
        epochs = [[moved[1] for moved in loader] for _ in range(2)]
        stats = service.stats()
        explained = loader.reading_service.plan.explain()
    finally:
        loader.shutdown()
    assert epochs == [list(range(20))] * 2
    assert stats.device is not None and stats.device.items == 40 and stats.device.device == "cuda"
    assert "to cuda: 40 items" in stats.summary()
    assert "Items reach the loop on cuda" in explained


def test_a_checkpoint_with_items_copied_ahead_resumes_with_exactly_the_rest(fake_device):
    """Items enqueued for the device but not handed out were not seen by the user: a
    restored run must yield them."""

    def make_pipe():
        return IterableWrapper(range(30)).sharding_filter().map(pipelines.identity)

    service = MultiProcessingReadingService(2, pin_memory=True, device="cuda", device_prefetch=4)
    loader = DataLoader2(make_pipe(), reading_service=service)
    try:
        iterator = iter(loader)
        first = [next(iterator)[1] for _ in range(7)]
        state = loader.state_dict()
    finally:
        loader.shutdown()
    assert first == list(range(7))
    service = MultiProcessingReadingService(2, pin_memory=True, device="cuda", device_prefetch=4)
    restored = DataLoader2.from_state(state, service)
    try:
        rest = [moved[1] for moved in restored]
    finally:
        restored.shutdown()
    assert rest == list(range(7, 30))


class EventuallyPassing:
    """A page-locker whose fences pass on the ``after``-th look (never, for None)."""

    def __init__(self, after: int | None) -> None:
        self.after, self.looks = after, 0

    def register(self, address, nbytes):
        return True

    def unregister(self, address):
        pass

    def fence(self):
        return object()

    def passed(self, token, blocked):
        self.looks += 1
        return self.after is not None and self.looks >= self.after

    def allocate(self, nbytes):
        return bytearray(nbytes)


@pytest.mark.parametrize("after", [5, None])
def test_closing_a_feed_waits_for_copies_in_flight_but_never_past_its_bound(monkeypatch, after):
    import multiprocessing

    import numpy as np

    from mprs_plus.transport import _lend, lending, open_channel

    if not hasattr(_lend, "lock_pages_with") or open_channel.__module__.endswith("pipe"):
        pytest.skip("lend areas are the shared-memory transport's")
    locker = EventuallyPassing(after)
    monkeypatch.setattr(feeding, "SETTLE", 0.2)
    _lend.lock_pages_with(locker)
    sender, receiver = open_channel(multiprocessing.get_context("fork"), capacity_items=8, capacity_bytes=1 << 20)
    try:
        sender.send(np.ones(256 << 10, dtype=np.uint8))
        item = receiver.recv(timeout=5)
        del item  # a copy 'reads' it until the fence passes
        assert lending().awaiting_device == 1
        Feeding(None, 0).close()  # bounded: returns whether or not the fence passed
        assert lending().awaiting_device == (0 if after is not None else 1)
    finally:
        _lend.lock_pages_with(None)
        sender.close()
        receiver.close()
        locker.after = locker.looks  # let whatever still waits go back
        assert lending().awaiting_device == 0


def test_fences_that_never_pass_never_stall_the_workers():
    """A device that never finishes its copies holds every lent extent: the workers'
    buffers must then go through the ring as copies, every item intact, no wait."""
    from mprs_plus.transport import TRANSPORT, _lend, lending

    if TRANSPORT != "shm":
        pytest.skip("lend areas are the shared-memory transport's")
    never = EventuallyPassing(None)
    _lend.lock_pages_with(never)
    lent_before, copied_before = lending().lent, lending().copied
    service = MultiProcessingReadingService(2, worker_prefetch_cnt=2, main_prefetch_cnt=2)
    # 4 MiB items, 40 per worker: past the held bound of a channel (HOLD_FACTOR x its ring).
    loader = DataLoader2(IterableWrapper(range(80)).sharding_filter().map(huge_tensor), reading_service=service)
    try:
        got = [int(t[0]) for t in loader if bool((t == t[0]).all())]  # dropped at once, fence never passes
    finally:
        loader.shutdown()
        _lend.lock_pages_with(None)
        never.after = never.looks  # what still waits goes back
    assert got == list(range(80))
    assert lending().copied - copied_before > 0  # the held bound was reached: copies, not a wait
    assert lending().lent - lent_before > 0
    assert lending().awaiting_device == 0


def test_graph_walks_see_the_main_segment_behind_the_feed_not_the_device():
    from torch.utils.data.graph import traverse_dps

    from mprs_plus.runtime.main.feeding import FedPipe

    class Unpicklable:
        def __reduce__(self):
            raise TypeError("a device stream cannot be pickled")

    main = IterableWrapper(range(3)).map(pipelines.identity)
    feed = Feeding(None, 0)
    feed._mover = Unpicklable()
    fed = FedPipe(main, feed)
    graph = traverse_dps(fed)
    (inner,) = graph[id(fed)][1].values()
    assert inner[0] is main
    import copy

    assert copy.deepcopy(fed) is fed


class _Batch:
    """An item that can be weakly referenced, standing in for a batch on the device."""


class _KeepNothingMover(FakeMover):
    def start(self, box):
        return box.pop(), 0

    def hand_out(self, moved, token):
        return moved, False


@pytest.mark.parametrize("feed", ["ahead", "pinned"])
def test_a_batch_the_loop_dropped_is_not_kept_by_the_feed(feed):
    """``del batch`` frees it at once: the feed keeps no reference to what it handed out (a
    batch on the GPU would otherwise stay allocated until the loop's next ``next()``)."""
    import weakref

    made = (_Batch() for _ in range(4))  # keeps none of them either
    if feed == "ahead":
        stream = feed_ahead(made, _KeepNothingMover(), 2, FeedCounters())
    else:
        stream = feeding.pin_each(made, FeedCounters())
    batch = next(stream)
    dropped = weakref.ref(batch)
    del batch
    assert dropped() is None, "the feed still holds the batch the loop dropped"
    assert len(list(stream)) == 3
