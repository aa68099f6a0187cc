"""A stream landed in shared memory (``transport/landing.py``): a landing process reads the
socket and writes each frame, unread, into a ring this process reads. Items, arrays (lent,
not copied), the end of the stream, a stream that breaks, a reader that closes, a stop
while nothing comes, and a secret that never appears where other users can read it."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import numpy
import psutil
import pytest

from mprs_plus.transport import ChannelBroken, EndOfStream
from mprs_plus.transport import stream as st
from mprs_plus.transport._lend import lending
from mprs_plus.transport import landing as landing_module
from mprs_plus.transport.landing import BROKEN, Landing

pytestmark = pytest.mark.timeout(60)


def _listening_sender(items: int = 8, size: int = 4 << 20) -> tuple[st.StreamSender, st.StreamSpec, tuple[str, int]]:
    spec = st.StreamSpec(st.new_secret(), items, size)
    address = st.listen(spec)
    return st.StreamSender(spec), spec, address


@contextlib.contextmanager
def _landed(address: tuple[str, int], spec: st.StreamSpec) -> Iterator[Landing]:
    """A landing process for the sender at ``address``; closed and stopped afterwards."""
    landing = Landing.start(address, spec)
    try:
        yield landing
    finally:
        landing.receiver.close()
        landing.stop()


def _in_thread(body) -> threading.Thread:
    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def patient_stop(monkeypatch):
    """A stop that waits 30 s before it kills: a landing process that ends with status 0
    ended by itself, however slowly a loaded machine schedules it."""
    monkeypatch.setattr(landing_module, "STOP_SECONDS", 30.0)


@pytest.fixture(autouse=True)
def no_listener_left():
    yield
    st.close_listeners()


def test_items_and_arrays_land_in_order_and_arrays_come_lent_then_the_stream_ends():
    sender, spec, address = _listening_sender()

    def produce() -> None:
        for i in range(300):
            sender.send(i)
        for i in range(40):
            sender.send({"i": i, "array": numpy.full(1 << 18, i, dtype=numpy.float32)})  # 1 MiB
        sender.close()

    thread = _in_thread(produce)
    lent_before = lending().lent
    try:
        with _landed(address, spec) as landing:
            receiver = landing.receiver
            assert [receiver.recv(30) for _ in range(300)] == list(range(300))
            for i in range(40):
                message = receiver.recv(30)
                assert message["i"] == i and (message["array"] == i).all()
                del message
            assert lending().lent > lent_before  # views of the lend area: no copy here
            with pytest.raises(EndOfStream):
                receiver.recv(30)
            assert landing.process.wait(30) == 0
            assert landing.problem() is None
    finally:
        thread.join(30)


def test_a_stream_that_breaks_mid_message_is_a_broken_channel_that_says_why():
    sender, spec, address = _listening_sender()
    served = threading.Event()

    def send_half_then_vanish() -> None:
        sender.send("whole")
        sock = sender._live(time.monotonic() + 30)
        # A frame's size promising a megabyte, then a few bytes of it, then the end.
        sock.setblocking(True)
        sock.sendall(st._SIZE.pack(1 << 20) + b"\0" * 100)
        served.set()
        sock.shutdown(socket.SHUT_RDWR)
        sender.release()

    thread = _in_thread(send_half_then_vanish)
    try:
        with _landed(address, spec) as landing:
            assert landing.receiver.recv(30) == "whole"
            with pytest.raises(ChannelBroken):
                landing.receiver.recv(30)  # never half an item
            assert landing.process.wait(30) == BROKEN
            assert "closed the connection" in (landing.problem() or "") or "broke" in (landing.problem() or "")
    finally:
        thread.join(30)
    assert served.is_set()


def test_a_reader_that_closes_ends_the_landing_process_by_itself():
    sender, spec, address = _listening_sender(items=2, size=1 << 16)
    thread = _in_thread(lambda: [sender.send(i, 30) for i in range(3)])
    try:
        with _landed(address, spec) as landing:
            assert landing.receiver.recv(30) == 0
            thread.join(30)
            landing.receiver.close()  # with messages still to land: the next send sees it
            assert landing.process.wait(30) == 0
    finally:
        sender.release()


def test_stop_ends_a_landing_process_that_waits_for_a_silent_peer(patient_stop):
    sender, spec, address = _listening_sender()
    thread = _in_thread(lambda: sender.send("only"))
    try:
        with _landed(address, spec) as landing:
            assert landing.receiver.recv(30) == "only"
            thread.join(30)
            landing.stop()  # the peer sends nothing more: the landing process waits on it
            assert landing.process.returncode == 0  # it ended by itself: it was not killed
    finally:
        sender.release()


def test_a_landing_process_that_cannot_prove_the_secret_is_refused_and_says_so():
    sender, spec, address = _listening_sender()
    wrong = st.StreamSpec(st.new_secret(), spec.capacity_items, spec.capacity_bytes, key=spec.key)
    before = st.refused_connections()
    try:
        with _landed(address, wrong) as landing:
            with pytest.raises(ChannelBroken):
                landing.receiver.recv(30)
            assert landing.process.wait(30) == BROKEN
            assert "handshake" in (landing.problem() or "")
            deadline = time.monotonic() + 30
            while st.refused_connections() == before and time.monotonic() < deadline:
                time.sleep(0.01)  # the listener's thread counts it after closing the connection
            assert st.refused_connections() == before + 1
    finally:
        sender.release()


def test_the_secret_travels_through_a_pipe_never_on_the_command_line():
    sender, spec, address = _listening_sender()
    thread = _in_thread(lambda: sender.send("x"))
    try:
        with _landed(address, spec) as landing:
            assert landing.receiver.recv(30) == "x"  # running, its command line settled
            command = " ".join(psutil.Process(landing.process.pid).cmdline())
            assert "mprs_plus.transport.landing" in command
            assert spec.secret.hex() not in command
    finally:
        thread.join(30)
        sender.release()


def test_a_forked_child_of_the_reader_does_not_keep_a_landing_process_alive(patient_stop):
    """The stop is end of file on a pipe: a fork of the reader closes its copy of that
    pipe's end at once, so the reader's stop still ends the landing process."""
    import os

    sender, spec, address = _listening_sender()
    thread = _in_thread(lambda: sender.send("x"))
    landing = Landing.start(address, spec)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the child: holds the fork's copies until the parent has stopped the landing
        try:
            os.close(write_end)
            os.read(read_end, 1)
        finally:
            os._exit(0)
    try:
        os.close(read_end)
        assert landing.receiver.recv(30) == "x"
        landing.stop()
        assert landing.process.returncode == 0  # it ended by itself: it was not killed
    finally:
        os.close(write_end)  # the child ends
        os.waitpid(child, 0)
        landing.receiver.close()
        landing.stop()
        thread.join(30)
        sender.release()


def test_every_byte_lands_as_sent_through_lent_ring_and_oversized_frames_with_reused_buffers():
    """Sizes that take every path of the ring (below the lend threshold, lent, larger than
    the whole ring) in a mixed order, each item's bytes a pattern of its own: the landing
    process reuses its receive buffers from message to message, so an item reused too
    early would show here as another item's bytes."""
    sizes = [64 << 10, 200 << 10, 3 << 20, 1 << 20, 5, 64 << 10, 3 << 20, 200 << 10] * 6
    sender, spec, address = _listening_sender(items=4, size=1 << 20)

    def pattern(i: int, n: int) -> numpy.ndarray:
        return ((numpy.arange(n, dtype=numpy.uint32) * 7 + i) % 251).astype(numpy.uint8)

    def produce() -> None:
        for i, n in enumerate(sizes):
            sender.send((i, pattern(i, n)), 30)
        sender.close()

    thread = _in_thread(produce)
    try:
        with _landed(address, spec) as landing:
            for i, n in enumerate(sizes):
                index, array = landing.receiver.recv(30)
                assert index == i and array.nbytes == n
                assert numpy.array_equal(array, pattern(i, n)), f"item {i} ({n} bytes) differs"
                del array
            with pytest.raises(EndOfStream):
                landing.receiver.recv(30)
    finally:
        thread.join(30)
