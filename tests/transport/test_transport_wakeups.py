"""No lost wake-up: the sleeping protocol of ``_wakeup.py``, its races made deterministic,
and the watchdog that stands in for a wake-up should one ever go missing.

The shared-memory rings' own protocol (their sleeping flags and wake-up pipes): the pipe
transport has none, each of its waits being the kernel's on the data itself.

A race is forced by running the waker *inside* the waiter's critical window (between its
last check and its block), through a hook, so each test takes the losing interleaving
every time instead of once in thousands of runs."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import types

import pytest
from mprs_plus.transport import EndOfStream, open_channel, release_all_except, wait_readable
from mprs_plus.transport import _ring, _wakeup
from transport_peers import shm_only

pytestmark = shm_only

FORK = multiprocessing.get_context("fork")


@pytest.fixture
def channel():
    sender, receiver = open_channel(FORK, capacity_items=1, capacity_bytes=1)
    yield sender, receiver
    sender.close()
    receiver.close()


@pytest.fixture
def idle_receiver():
    """A second receiver that never gets a message: waiting on two receivers takes
    ``wait_readable``'s general path, one receiver its single-receiver path."""
    sender, receiver = open_channel(FORK, capacity_items=1, capacity_bytes=1)
    yield receiver
    sender.close()
    receiver.close()


def _wait_readable(how, receiver, idle_receiver, timeout):
    """``wait_readable`` on ``receiver`` alone, or together with an idle receiver."""
    waited = [receiver] if how == "wait_readable" else [receiver, idle_receiver]
    return wait_readable(waited, timeout=timeout)


WAYS = ["recv", "wait_readable", "wait_readable of two"]


def test_a_message_sent_between_the_readers_check_and_its_block_wakes_it(channel, monkeypatch):
    # The lost wake-up once seen in the field: wait_readable armed the receiver, saw an
    # empty ring, and then (asking whether the sender was gone) read the wake-up pipe,
    # swallowing the byte of a message published after its check. It then slept on data
    # that was there. Here the message is sent exactly in that window: right after the
    # armed receiver's look at its ring.
    sender, receiver = channel
    real = type(receiver).has_input
    sent = []

    def check_then_race(self):
        found = real(self)
        if self is receiver and not sent and receiver._ctl[_ring.RX_SLEEPING]:
            sender.send("in the window")  # sees the flag, clears it, writes the byte
            sent.append(True)
        return found

    monkeypatch.setattr(type(receiver), "has_input", check_then_race)
    ready = wait_readable([receiver], timeout=2.0)
    assert sent, "the race was not provoked"
    assert ready == [receiver]
    assert receiver.recv(timeout=0) == "in the window"
    # Woken by its byte, not rescued by the watchdog (without one, a reader waiting with
    # no timeout would have slept forever): the protocol itself holds. Counted, not timed.
    assert receiver.traffic().rescues == 0


@pytest.mark.parametrize("how", WAYS)
def test_a_message_sent_in_the_window_before_the_block_wakes_the_reader(channel, idle_receiver, monkeypatch, how):
    sender, receiver = channel
    monkeypatch.setattr(_wakeup, "SPIN_SECONDS", 0.0)
    hits = []

    def race(label):
        if not hits:
            hits.append(label)
            sender.send("raced")

    monkeypatch.setattr(_wakeup, "race_hook", race, raising=False)
    if how == "recv":
        assert receiver.recv(timeout=2.0) == "raced"
    else:
        assert _wait_readable(how, receiver, idle_receiver, 2.0) == [receiver]
        assert receiver.recv(timeout=0) == "raced"
    assert hits == ["armed"]
    assert receiver.traffic().rescues == 0


def _undo_the_wake_up(waker, looked_word, waiter, flag, what):
    """Undo a waker's wake-up once it published: the byte drained, the waiter's flag set
    again. ``what`` says why no byte came. "lost": the waker looked and still wrote none,
    a bug not found yet (its looked-at word stays as it left it). "late": it was kept off
    the CPU between publishing (1) and looking (3), as a loaded machine may do (its
    looked-at word goes back to before the publish)."""
    looked = waker._ctl[looked_word]

    def undo():
        assert _wakeup.drain(waiter._wait_fd) is False  # the waker had written its byte: gone
        waiter._ctl[flag] = 1
        if what == "late":
            waker._ctl[looked_word] = looked

    return undo


@pytest.mark.parametrize("what", ["lost", "late"])
@pytest.mark.parametrize("how", WAYS)
def test_the_watchdog_wakes_a_reader_whose_wake_up_never_came_and_counts_why(
    channel, idle_receiver, monkeypatch, how, what
):
    # The message is published and its wake-up byte is gone before the reader blocks. The
    # reader must still get it, within about one watchdog interval, and the channel's
    # traffic must count why: a rescue (a bug) or a late wake-up (a loaded machine).
    sender, receiver = channel
    monkeypatch.setattr(_wakeup, "SPIN_SECONDS", 0.0)
    hits = []

    def publish_without_a_wake_up(label):
        if not hits:
            hits.append(label)
            undo = _undo_the_wake_up(sender, _ring.TX_LOOKED, receiver, _ring.RX_SLEEPING, what)
            sender.send("published")
            undo()

    monkeypatch.setattr(_wakeup, "race_hook", publish_without_a_wake_up, raising=False)
    # Within the 5 s timeout (the watchdog looks every WATCHDOG_SECONDS); how much sooner
    # depends on the scheduler, so only the counts are checked.
    if how == "recv":
        assert receiver.recv(timeout=5.0) == "published"
    else:
        assert _wait_readable(how, receiver, idle_receiver, 5.0) == [receiver]
        assert receiver.recv(timeout=0) == "published"
    assert hits == ["armed"]
    counts = {"lost": (1, 0), "late": (0, 1)}[what]
    for end in (receiver, sender):  # the same shared figures from either end
        traffic = end.traffic()
        assert (traffic.rescues, traffic.late_wakeups) == counts
    if what == "late":
        # The sender looks at last: the flag is clear, so it writes nothing, and its word
        # catches up.
        sender._wake_receiver()
        assert _wakeup.drain(receiver._wait_fd) is False
        assert sender._ctl[_ring.TX_LOOKED] == _ring.producer_progress(sender._ctl)


@pytest.mark.parametrize("what", ["lost", "late"])
def test_the_watchdog_wakes_a_sender_whose_wake_up_never_came_and_counts_why(channel, monkeypatch, what):
    sender, receiver = channel
    monkeypatch.setattr(_wakeup, "SPIN_SECONDS", 0.0)
    sender.send("fills the ring")
    hits = []

    def read_without_a_wake_up(label):
        if not hits:
            hits.append(label)
            undo = _undo_the_wake_up(receiver, _ring.RX_LOOKED, sender, _ring.TX_SLEEPING, what)
            assert receiver.recv(timeout=0) == "fills the ring"  # makes room, wakes the sender
            undo()

    monkeypatch.setattr(_wakeup, "race_hook", read_without_a_wake_up, raising=False)
    sender.send("needs room", timeout=5.0)
    assert hits == ["armed"]
    assert receiver.recv(timeout=0) == "needs room"
    traffic = sender.traffic()
    assert (traffic.rescues, traffic.late_wakeups) == {"lost": (1, 0), "late": (0, 1)}[what]


def _assert_both_looked(ctl):
    """Each side's looked-at word equals its progress: every path that published looked
    (so a word behind means a look still to come, never one skipped)."""
    assert ctl[_ring.TX_LOOKED] == _ring.producer_progress(ctl)
    assert ctl[_ring.RX_LOOKED] == _ring.consumer_progress(ctl)


def test_every_path_that_publishes_looks_at_the_peers_flag():
    import pickle

    from mprs_plus.transport._lend import LEND_MIN

    sender, receiver = open_channel(FORK, capacity_items=4, capacity_bytes=1)
    ctl = sender._ctl
    ring = sender._size
    try:
        sender.send("small")  # the inline paths
        _assert_both_looked(ctl)
        assert receiver.recv(timeout=0) == "small"
        _assert_both_looked(ctl)
        small_buffer = pickle.PickleBuffer(bytearray(b"b" * 512))  # out of band, in the ring
        sender.send(small_buffer)
        _assert_both_looked(ctl)
        assert bytes(receiver.recv(timeout=0)) == b"b" * 512
        _assert_both_looked(ctl)
        lent = pickle.PickleBuffer(bytearray(b"L" * LEND_MIN))  # through the lend area
        sender.send(lent)
        _assert_both_looked(ctl)
        assert bytes(receiver.recv(timeout=0)) == b"L" * LEND_MIN
        _assert_both_looked(ctl)
        for message in ("to skip", lent):
            sender.send(message)
            assert receiver.skip() is True
            _assert_both_looked(ctl)
        for index in range(ring // 1024 + 4):  # past the recycle point: a SKIP frame
            sender.send(b"r" * 1000)
            assert receiver.recv(timeout=0) == b"r" * 1000
        assert ctl[_ring.SKIPPED] > 0
        _assert_both_looked(ctl)
        # A frame larger than the ring streams through it while the reader copies it
        # out, or reads it through to skip it.
        big = b"s" * (3 * ring)
        for take in (lambda: receiver.recv(timeout=10.0) == big, receiver.skip):
            failures = []

            def stream():
                try:
                    sender.send(big, timeout=10.0)
                except BaseException as exc:  # reported below
                    failures.append(exc)

            writer = threading.Thread(target=stream)
            writer.start()
            assert receiver.wait(timeout=10.0) == [receiver]
            assert take() is True
            writer.join(timeout=10.0)
            assert not writer.is_alive() and not failures
            _assert_both_looked(ctl)
        sender.close()  # the end of the stream
        with pytest.raises(EndOfStream):
            receiver.recv(timeout=0)
        assert receiver._ctl[_ring.TX_LOOKED] == _ring.producer_progress(receiver._ctl)
    finally:
        sender.close()
        receiver.close()


def test_a_receiver_that_closes_looks_at_the_senders_flag():
    sender, receiver = open_channel(FORK, capacity_items=1, capacity_bytes=1)
    try:
        sender.send("unread")
        receiver.close()
        assert sender._ctl[_ring.RX_LOOKED] == _ring.consumer_progress(sender._ctl)
    finally:
        sender.close()


def test_poll_never_swallows_a_wake_up(channel):
    # poll() may be called at any time, also between another wait's check and block;
    # it must leave the pipe alone.
    sender, receiver = channel
    receiver.arm()
    sender.send("x")  # writes the byte
    assert receiver.poll()
    assert receiver._ctl[_ring.RX_SLEEPING] == 0  # the sender cleared the flag
    receiver.disarm(woken=False)
    assert os.read(receiver._wait_fd, 16) == b"\x01"  # the byte is still there
    assert receiver.recv(timeout=0) == "x"


# -- stress: thousands of sleeps and wake-ups with rings of one message, both directions --

ROUNDS = 10_000


FORCED_EVERY = 10  # every tenth reply waits until its reader is asleep for it


def _echo_forever(requests, replies, force_every: int = 0) -> None:
    """Echo every request. With ``force_every``, hold back every such reply until the
    reader has armed its wake-up for it (``peer_waiting``), so the handshake under stress
    is exercised on those rounds whatever the scheduler does; exit code 3 if the reader
    never armed within 30 s."""
    release_all_except([requests, replies])
    _wakeup.SPIN_SECONDS = 0.0  # every wait sleeps: the handshake runs for nearly every message
    try:
        while True:
            request = requests.recv(timeout=60)
            if force_every and request % force_every == 0:
                deadline = time.monotonic() + 30
                while not replies.peer_waiting():
                    if time.monotonic() > deadline:
                        os._exit(3)
                    os.sched_yield()
            replies.send(request)
    except EndOfStream:
        replies.close()


@pytest.mark.timeout(120)
def test_stress_ping_pong_with_rings_of_one_message(monkeypatch):
    monkeypatch.setattr(_wakeup, "SPIN_SECONDS", 0.0)
    requests_tx, requests_rx = open_channel(FORK, capacity_items=1, capacity_bytes=1)
    replies_tx, replies_rx = open_channel(FORK, capacity_items=1, capacity_bytes=1)
    process = FORK.Process(target=_echo_forever, args=(requests_rx, replies_tx, FORCED_EVERY), daemon=True)
    process.start()
    requests_rx.release()
    replies_tx.release()
    replies_rx.watch(process.sentinel)
    requests_tx.watch(process.sentinel)
    try:
        # Two in flight: each side keeps finding the other's ring full (the sender sleeps)
        # or empty (the receiver sleeps); half the replies are awaited with wait_readable.
        requests_tx.send(0)
        for i in range(1, ROUNDS):
            requests_tx.send(i, timeout=30)
            if i % 2:
                assert wait_readable([replies_rx], timeout=30) == [replies_rx]
            assert replies_rx.recv(timeout=30) == i - 1
        assert replies_rx.recv(timeout=30) == ROUNDS - 1
        assert requests_tx.traffic().rescues == 0
        requests_tx.close()
        with pytest.raises(EndOfStream):
            replies_rx.recv(timeout=30)
        assert replies_rx.traffic().rescues == 0
        # How often the scheduler makes either side sleep varies from run to run; the
        # echo forced the armed-reader handshake on every FORCED_EVERY-th round and
        # exits 3 if one of them never came.
        process.join(30)
        assert process.exitcode == 0, "the reader never armed its wake-up on a forced round"
    finally:
        requests_tx.close()
        replies_rx.close()
        process.join(30)


def test_a_waiter_stops_spinning_while_spins_keep_failing_and_spins_again_when_one_pays(channel, monkeypatch):
    """A failed spin burns its whole budget for nothing (a process waiting for each large
    item did that on every item): after SPIN_MISSES of them the waiter sleeps after one
    yield (no spin), probing now and then, and one spin that succeeds brings spinning back.

    The spin's clock is the test's: it moves a tenth of the budget per ``sched_yield``, so
    a spin yields up to ten times however the scheduler runs this thread (on the real
    clock a preemption longer than the budget ends a spin before its first yield), and the
    sleep after a failed spin times out at once."""
    _, receiver = channel
    yields = []
    clock = [0.0]

    def sched_yield() -> None:
        yields.append(1)
        clock[0] += _wakeup.SPIN_SECONDS / 10

    monkeypatch.setattr(_wakeup.os, "sched_yield", sched_yield)
    monkeypatch.setattr(_wakeup, "time", types.SimpleNamespace(perf_counter=lambda: clock[0], monotonic=time.monotonic))
    sleeper = receiver._sleeper
    monkeypatch.setattr(sleeper, "_sleep", lambda *args: _wakeup.Outcome.TIMEOUT)
    never = lambda: False  # noqa: E731
    spun = []
    for _ in range(_wakeup.SPIN_MISSES + 2):
        yields.clear()
        assert sleeper.wait(never) == _wakeup.Outcome.TIMEOUT
        spun.append(len(yields))
    assert all(n >= 9 for n in spun[: _wakeup.SPIN_MISSES]), spun  # its whole budget
    assert spun[_wakeup.SPIN_MISSES :] == [1, 1]  # one yield, no spin
    # The probe: one wait in SPIN_PROBE still spins, and this time the condition comes true.
    calls = []

    def soon() -> bool:
        calls.append(1)
        return len(calls) > 3

    while (sleeper._waits + 1) % _wakeup.SPIN_PROBE:
        yields.clear()
        sleeper.wait(never)
        assert yields == [1]  # no spin between probes
    yields.clear()
    assert sleeper.wait(soon) == _wakeup.Outcome.READY and len(yields) > 1
    yields.clear()
    calls.clear()
    assert sleeper.wait(soon) == _wakeup.Outcome.READY and len(yields) > 1  # spinning is back


def test_a_waiter_that_no_longer_spins_yields_once_before_it_arms(channel, monkeypatch):
    """Not spinning, a waiter still gives its core away once before it sleeps (a loop that
    slept at once took a core from the workers for every batch: ``Sleeper.wait``). Forced:
    the waiter's misses are at the rule's limit, and the order of its yield and its arming
    is recorded."""
    _, receiver = channel
    events: list[str] = []
    monkeypatch.setattr(_wakeup.os, "sched_yield", lambda: events.append("yield"))
    monkeypatch.setattr(_wakeup, "race_hook", events.append, raising=False)
    sleeper = receiver._sleeper
    sleeper._misses = _wakeup.SPIN_MISSES
    sleeper._waits = 0  # the next wait is not a probe
    deadline = time.monotonic() + 0.05
    assert sleeper.wait(lambda: False, deadline) == _wakeup.Outcome.TIMEOUT
    assert events[:2] == ["yield", "armed"], events
    assert events.count("yield") == 1, events


@pytest.mark.parametrize("how", WAYS)
def test_a_thread_asleep_in_a_channel_wait_is_reported_until_it_wakes(channel, idle_receiver, how):
    """``note_blocking``: the stamp a runtime reads to tell a wait that can never end."""
    sender, receiver = channel
    notes: list[float] = []
    asleep = threading.Event()

    def note(since: float) -> None:
        notes.append(since)
        if since:
            asleep.set()

    def read() -> None:
        _wakeup.note_blocking(note)
        try:
            if how == "recv":
                receiver.recv()
            else:
                _wait_readable(how, receiver, idle_receiver, 30)
        finally:
            _wakeup.note_blocking(None)

    reader = threading.Thread(target=read)
    reader.start()
    assert asleep.wait(30)  # it went to sleep, and said since when
    assert notes[0] <= time.monotonic()
    sender.send("wake up")
    reader.join(30)
    assert not reader.is_alive()
    assert notes[-1] == 0.0 and all(notes[i] > 0 for i in range(0, len(notes), 2))


class _InterruptedOnceHeld:
    """A lock whose first successful acquire is followed at once by KeyboardInterrupt, as
    when Ctrl-C's handler runs in the main thread right after ``acquire()`` returned."""

    def __init__(self) -> None:
        self.real = threading.Lock()
        self.interrupted = False

    def acquire(self, *args: object) -> bool:
        taken = self.real.acquire(*args)
        if taken and not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        return taken

    def release(self) -> None:
        self.real.release()


def test_a_fence_left_holding_its_lock_by_ctrl_c_never_blocks_the_next_one(monkeypatch):
    """A Ctrl-C'd service's stop still sends and waits through the channels, each send and
    wait with a fence: the fence that the interrupt cut short must not make the next one
    wait for a lock that nobody will release."""
    lock = _InterruptedOnceHeld()
    monkeypatch.setattr(_wakeup, "_fence_lock", lock)
    with pytest.raises(KeyboardInterrupt):
        _wakeup.fence()
    assert lock.real.locked()  # the interrupted fence left it held
    fenced = threading.Event()
    thread = threading.Thread(target=lambda: (_wakeup.fence(), _wakeup.fence(), fenced.set()), daemon=True)
    thread.start()
    thread.join(10)
    assert fenced.is_set(), "fence() waited for a lock that an interrupted fence left held"


def test_a_full_sender_of_a_channel_refilled_at_half_is_woken_once_half_of_it_was_read(monkeypatch):
    # Woken at every message read, a sender ahead of a reader that takes its messages in
    # turn with other channels' cost each side a wake-up per message. It sleeps until
    # half the messages it waited behind were read, and is woken then, once, by the read
    # that makes that room: no earlier wake-up, no watchdog standing in for one.
    monkeypatch.setattr(_wakeup, "SPIN_SECONDS", 0.0)
    monkeypatch.setattr(_wakeup, "_WATCHDOG_MS", 60_000)  # only the reads may wake it
    sender, receiver = open_channel(FORK, capacity_items=8, capacity_bytes=1 << 20, refill_at_half=True)
    armed = threading.Semaphore(0)
    monkeypatch.setattr(_wakeup, "race_hook", lambda label: armed.release(), raising=False)
    try:
        for i in range(8):
            sender.send(i, timeout=0)
        worker = threading.Thread(target=sender.send, args=("ninth",), daemon=True)
        worker.start()
        assert armed.acquire(timeout=30)  # asleep, waiting for room
        for i in range(3):
            assert receiver.recv(timeout=0) == i
            assert sender._ctl[_ring.TX_SLEEPING] == 1  # not woken: 5 or more still unread
        assert receiver.recv(timeout=0) == 3  # half read: this one wakes it
        worker.join(30)
        assert not worker.is_alive()
        assert not armed.acquire(timeout=0)  # it slept once, and went on after one wake-up
        assert [receiver.recv(timeout=0) for _ in range(5)] == [4, 5, 6, 7, "ninth"]
        assert sender.traffic().rescues == 0
    finally:
        sender.close()
        receiver.close()
