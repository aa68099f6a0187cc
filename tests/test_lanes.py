"""The pieces inside the processes, driven in one process: the channel mux, a child's lanes
and control listener; and items that cannot travel."""

from __future__ import annotations

import multiprocessing
import pickle
import threading
import time

import pytest
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

import pipelines
from mprs_plus import MultiProcessingReadingService
from mprs_plus.runtime.child.loop import ChildLoop
from mprs_plus.runtime.child.control import SegmentControl, SegmentOutputs
from mprs_plus.runtime.child.lanes import OutputLane
from mprs_plus.runtime.data_messages import Kind
from mprs_plus.runtime.mux import ChannelMux, WakePipe
from mprs_plus.runtime.control_messages import Reset, pack
from mprs_plus.transport import open_channel, wait_readable

CTX = multiprocessing.get_context("fork")


def channel():
    return open_channel(CTX, capacity_items=8, capacity_bytes=1 << 20)


def _mux(receivers):
    index_of = {id(r): i for i, r in enumerate(receivers)}
    return ChannelMux(
        receivers,
        recv=lambda i: receivers[i].recv(),
        wait=lambda ids: [index_of[id(r)] for r in wait_readable([receivers[i] for i in ids])],
    )


def test_mux_drops_stale_messages_and_keeps_newer_ones_for_their_reader():
    (tx0, rx0), (tx1, rx1) = channel(), channel()
    mux = _mux([rx0, rx1])
    mux.advance(2)
    tx0.send((Kind.ITEMS, 1, ["stale"]))
    tx0.send((Kind.ITEMS, 2, ["a"]))
    tx1.send((Kind.ITEMS, 3, ["next epoch"]))
    assert mux.take(0, 2) == (Kind.ITEMS, 2, ["a"])
    assert mux.take(1, 2) is None  # epoch 2 is over for channel 1 ...
    mux.advance(3)
    assert mux.take(1, 3) == (Kind.ITEMS, 3, ["next epoch"])  # ... and the message waited for 3
    assert mux.take(0, 2) is None  # a reader of an abandoned epoch ends at once
    for end in (tx0, rx0, tx1, rx1):
        end.close()


@pytest.mark.timeout(30)
def test_mux_drains_other_channels_while_waiting():
    """A reader waiting on channel 0 reads channel 1 meanwhile: its stale messages are
    dropped, so their producer, blocked behind them, gets to send what the reader waits for."""
    (tx0, rx0), (tx1, rx1) = channel(), channel()
    mux = _mux([rx0, rx1])
    mux.advance(5)

    def producer():
        for _ in range(50):  # far more than a channel holds: needs the reader to drain them
            tx1.send((Kind.ITEMS, 4, [bytes(8192)]))
        tx1.send((Kind.END, 5, None))
        tx0.send((Kind.ITEMS, 5, ["late"]))

    thread = threading.Thread(target=producer)
    thread.start()
    assert mux.take(0, 5) == (Kind.ITEMS, 5, ["late"])
    thread.join(10)
    assert mux.take_any([1], 5) == (1, (Kind.END, 5, None))
    for end in (tx0, rx0, tx1, rx1):
        end.close()


class Narrowing:
    """Two channels and a mux with a wake, as the service builds them: it waits on the
    channels it needs. Every wait's channels are recorded in ``waited``."""

    def __init__(self):
        (self.tx0, rx0), (self.tx1, rx1) = channel(), channel()
        self.ends = (self.tx0, rx0, self.tx1, rx1)
        self.waited = []
        receivers = [rx0, rx1]
        self.interrupt = interrupt = WakePipe()

        def wait(ids):
            self.waited.append(sorted(ids))
            ready = wait_readable([receivers[i] for i in ids], timeout=20, also=[interrupt.fd])
            if interrupt.fd in ready:
                interrupt.clear()
            return [receivers.index(r) for r in ready if r in receivers]

        self.mux = ChannelMux(receivers, recv=lambda i: receivers[i].recv(), wait=wait, wake=interrupt.wake)

    def current(self, epoch):
        """Epoch ``epoch``, with a message of it read from each channel: both known current."""
        self.mux.advance(epoch)
        self.tx0.send((Kind.ITEMS, epoch, ["a0"]))
        self.tx1.send((Kind.ITEMS, epoch, ["b0"]))
        assert self.mux.take(0, epoch)[2] == ["a0"]
        assert self.mux.take(1, epoch)[2] == ["b0"]

    def on_first_wait(self, action):
        """Run ``action`` when the mux first waits (then the waiting reader is committed)."""
        real_wait, started = self.mux._wait, []

        def wait(ids):
            if not started:
                started.append(True)
                action()
            return real_wait(ids)

        self.mux._wait = wait

    def close(self):
        for end in self.ends:
            end.close()
        self.interrupt.close()


@pytest.fixture
def narrowing():
    setup = Narrowing()
    yield setup
    setup.close()


@pytest.mark.timeout(30)
def test_an_in_order_reader_waits_only_for_the_channel_it_reads(narrowing):
    """Once both channels delivered a message of the epoch, a reader waiting for channel 0
    is not woken by channel 1's messages (they wait in their ring for their turn)."""
    narrowing.current(1)

    def producer():
        narrowing.tx1.send((Kind.ITEMS, 1, ["b1"]))
        narrowing.tx0.send((Kind.ITEMS, 1, ["a1"]))

    thread = threading.Thread(target=producer)
    narrowing.on_first_wait(thread.start)
    narrowing.waited.clear()
    assert narrowing.mux.take(0, 1) == (Kind.ITEMS, 1, ["a1"])
    thread.join(10)
    assert narrowing.waited and all(ids == [0] for ids in narrowing.waited), narrowing.waited
    assert narrowing.mux.take(1, 1) == (Kind.ITEMS, 1, ["b1"])


@pytest.mark.timeout(30)
def test_a_narrowed_wait_still_drains_stale_messages_after_a_new_epoch(narrowing):
    """After ``advance`` no channel is known to be current: a reader waiting on channel 0
    reads channel 1 too, and drops its stale messages, so their producer is not stuck."""
    narrowing.current(1)
    narrowing.mux.advance(2)

    def producer():
        for _ in range(50):  # far more than a channel holds
            narrowing.tx1.send((Kind.ITEMS, 1, [bytes(8192)]))
        narrowing.tx1.send((Kind.END, 2, None))
        narrowing.tx0.send((Kind.ITEMS, 2, ["late"]))

    thread = threading.Thread(target=producer)
    thread.start()
    assert narrowing.mux.take(0, 2) == (Kind.ITEMS, 2, ["late"])
    thread.join(10)
    assert not thread.is_alive()
    assert [0, 1] in narrowing.waited


@pytest.mark.timeout(30)
def test_a_second_reader_thread_interrupts_a_wait_that_does_not_cover_its_channel(narrowing):
    """Thread A waits for channel 0 (which stays empty); thread B then wants channel 1,
    which has a message: B gets it at once, though A's wait did not include channel 1."""
    narrowing.current(1)
    waiting = threading.Event()
    narrowing.on_first_wait(waiting.set)
    got_a = []
    reader_a = threading.Thread(target=lambda: got_a.append(narrowing.mux.take(0, 1)))
    reader_a.start()
    assert waiting.wait(10)
    narrowing.tx1.send((Kind.ITEMS, 1, ["b1"]))
    started = time.monotonic()
    assert narrowing.mux.take(1, 1) == (Kind.ITEMS, 1, ["b1"])
    assert time.monotonic() - started < 5  # not after A's 20 s wait timed out
    narrowing.tx0.send((Kind.ITEMS, 1, ["a1"]))
    reader_a.join(10)
    assert got_a == [(Kind.ITEMS, 1, ["a1"])]


def test_a_child_applies_control_with_every_lane_parked():
    control_tx, control_rx = channel()
    channels = [channel() for _ in range(2)]
    lanes = [OutputLane(tx, None, "test") for tx, _ in channels]
    outputs = [IterableWrapper(range(5)), IterableWrapper(range(10, 13))]
    seen_parked = []

    def reset(root, epoch, seed_generator, iter_reset_fn):
        return root

    segment = SegmentControl(SegmentOutputs(outputs), 2, reset, "test")

    class Watching:
        def apply(self, message, loop):
            seen_parked.append(loop.inbox.parked_or_gone())  # lane 1 parked while lane 0 applies
            segment.apply(message, loop)

    loop = ChildLoop(control_rx, lanes, Watching(), "test")
    runner = threading.Thread(target=loop.run)
    runner.start()
    try:
        for epoch in (1, 2):
            control_tx.send(Reset(epoch, pack((None, None))))
            read = []
            for _, rx in channels:
                stream = []
                while True:
                    kind, message_epoch, payload = rx.recv(10)
                    assert message_epoch == epoch
                    if kind == Kind.END:
                        break
                    stream += payload
                read.append(stream)
            assert read == [list(range(5)), list(range(10, 13))]
    finally:
        control_tx.close()  # the end of the control stream is the child's STOP
        runner.join(10)
    assert not runner.is_alive()
    assert seen_parked and all(count >= 1 for count in seen_parked)
    for tx, rx in channels:
        rx.close()


@pytest.mark.parametrize("dispatch", [False, True], ids=["from_a_worker", "from_the_dispatch_process"])
def test_an_item_that_cannot_travel_is_an_error_not_a_crash(dispatch):
    pipe = IterableWrapper(range(6))
    if dispatch:
        pipe = pipe.map(pipelines.unpicklable).sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
        pipe = pipe.map(pipelines.identity)
    else:
        pipe = pipe.sharding_filter().map(pipelines.unpicklable)
    loader = DataLoader2(pipe, reading_service=MultiProcessingReadingService(2))
    with pytest.raises(TypeError, match="cannot pickle 'generator' object") as info:
        list(loader)
    loader.shutdown()
    where = "dispatching process" if dispatch else "worker process"
    assert any(where in note for note in info.value.__notes__)


class _InterruptedOnceReleased:
    """The mux's condition, with Ctrl-C's KeyboardInterrupt raised once just after a
    release returns (where the main thread runs a signal's handler)."""

    def __init__(self, cv: threading.Condition) -> None:
        self._cv = cv
        self.interrupted = False

    def release(self) -> None:
        self._cv.release()
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt

    def __getattr__(self, name):
        return getattr(self._cv, name)


@pytest.mark.parametrize("where", ["pump", "before_block"])
def test_a_ctrl_c_as_the_mux_lets_go_of_its_lock_reaches_the_user_as_itself(where):
    """The mux lets go of its lock to wait (the pump) or to flush (``before_block``). A
    KeyboardInterrupt raised just then must reach the reader as a KeyboardInterrupt, with
    the lock let go, and the mux must go on serving."""
    (tx, rx), = [channel()]
    mux = _mux([rx])
    mux._cv = cv = _InterruptedOnceReleased(mux._cv)
    before_block = (lambda: None) if where == "before_block" else None
    try:
        with pytest.raises(KeyboardInterrupt):
            mux.take(0, 0, before_block)
        assert cv.interrupted and not mux._lock.locked()
        tx.send((Kind.ITEMS, 0, ["a"]))
        assert mux.take(0, 0)[2] == ["a"]
    finally:
        tx.close()
        rx.close()
