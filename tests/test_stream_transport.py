"""The stream transport (``transport/stream.py``): one TCP connection per channel, on
loopback here. Messages and large buffers between two processes, credits as backpressure,
the handshake that keeps strangers out before anything is unpickled, a stream that breaks
mid-message, and no socket or listening port left behind."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import struct
import threading
import time

import numpy
import psutil
import pytest

from mprs_plus.transport import ChannelBroken, ChannelClosed, EndOfStream, wait_readable
from mprs_plus.transport import stream as st

pytestmark = pytest.mark.timeout(60)


def _spec(items: int = 8, size: int = 1 << 22) -> st.StreamSpec:
    return st.StreamSpec(st.new_secret(), items, size)


def _channel(items: int = 8, size: int = 1 << 22) -> tuple[st.StreamSender, st.StreamReceiver, tuple[str, int]]:
    """A sender that listens here and a receiver that connects to it."""
    spec = _spec(items, size)
    address = st.listen(spec)
    return st.StreamSender(spec), st.StreamReceiver(spec, address), address


def _tcp_of_this_process() -> set[tuple]:
    return {(c.laddr, c.raddr, c.status) for c in psutil.Process().net_connections(kind="tcp")}


@pytest.fixture(autouse=True)
def no_sockets_left():
    """Every test leaves this process with the TCP sockets it had (none listening)."""
    before = _tcp_of_this_process()
    yield
    st.close_listeners()
    left = _tcp_of_this_process() - before
    assert not left, f"sockets left behind: {left}"


def _in_thread(body) -> threading.Thread:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            body()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.errors = errors  # type: ignore[attr-defined]
    thread.start()
    return thread


def _joined(thread: threading.Thread) -> None:
    thread.join(30)
    assert not thread.is_alive(), "the helper thread did not finish within 30 s"
    if thread.errors:  # type: ignore[attr-defined]
        raise thread.errors[0]  # type: ignore[attr-defined]


# -- between two processes --------------------------------------------------------------


def _produce(sender: st.StreamSender, count: int) -> None:
    for i in range(count):
        sender.send(i)
    for i in range(ARRAYS):
        sender.send({"array": numpy.full(300_000, i, dtype=numpy.float64), "i": i})
    sender.close()  # with megabytes still on their way, then the process exits


ARRAYS = 200


def _read_what_produce_sent(receiver, count: int, check_array=lambda array: None) -> None:
    """``_produce``'s messages, in order, each array checked by ``check_array`` too, then
    the end of the stream."""
    assert [receiver.recv(30) for _ in range(count)] == list(range(count))
    for i in range(ARRAYS):
        message = receiver.recv(30)
        array = message["array"]
        assert message["i"] == i and array.shape == (300_000,) and (array == i).all()
        check_array(array)
        del message, array
    with pytest.raises(EndOfStream):
        receiver.recv(30)


def test_messages_and_large_buffers_cross_processes_in_order_then_end_of_stream():
    """Also: a sender that closes, then exits, while its last messages are still in the
    kernel's buffers and its credits still coming, loses none of them (a socket closed
    with bytes of its peer unread is reset, and its unsent bytes dropped)."""
    spec = _spec(items=16, size=64 << 20)
    address = st.listen(spec)
    receiver = st.StreamReceiver(spec)  # this end listens; the child connects
    receiver_spec = st.StreamSender(spec, address)  # pickled to the child: spec + address
    child = multiprocessing.get_context("spawn").Process(target=_produce, args=(receiver_spec, 500))
    child.start()
    def owned(array):
        assert array.flags.writeable  # received into memory this process owns
        assert isinstance(array.base, bytearray)  # no copy of it after the kernel's

    try:
        _read_what_produce_sent(receiver, 500, owned)
    finally:
        child.join(30)
        receiver.close()
    assert child.exitcode == 0


def test_listens_on_loopback_unless_told_and_only_until_its_peer_is_in():
    sender, receiver, address = _channel()
    assert address[0] == "127.0.0.1"
    listening = [c for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
    assert any(c.laddr.port == address[1] for c in listening)
    thread = _in_thread(lambda: sender.send("hello"))
    assert receiver.recv(10) == "hello"
    _joined(thread)
    listening = [c for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
    assert not any(c.laddr.port == address[1] for c in listening)  # one connection per channel
    sender.close()
    receiver.close()


def test_a_connected_endpoint_does_not_travel():
    sender, receiver, _ = _channel()
    thread = _in_thread(lambda: sender.send(1))
    assert receiver.recv(10) == 1
    _joined(thread)
    with pytest.raises(TypeError, match="internal error"):
        pickle.dumps(receiver)
    sender.close()
    receiver.close()


# -- backpressure ---------------------------------------------------------------------------


def test_capacity_items_bounds_the_unread_messages():
    sender, receiver, _ = _channel(items=3)
    thread = _in_thread(lambda: [sender.send(i, timeout=10) for i in range(3)])
    assert receiver.recv(10) == 0  # connected; the credit of one message read went back
    _joined(thread)
    sender.send(3, timeout=10)  # room for exactly one more
    with pytest.raises(TimeoutError):
        sender.send(4, timeout=0.2)  # three unread: full, and nothing of it was sent
    assert sender.traffic().queued_messages == 3
    assert [receiver.recv(10) for _ in range(3)] == [1, 2, 3]
    # The receiver waits for more now, so it has returned every credit: room again.
    assert receiver.wait(0.05) == []
    sender.send(5, timeout=10)
    assert receiver.recv(10) == 5
    # Each end counts what went through it: five written (4 timed out unsent), five read.
    assert sender.traffic().messages == receiver.traffic().messages == 5
    assert receiver.traffic().bytes == sender.traffic().bytes
    sender.close()
    with pytest.raises(EndOfStream):
        receiver.recv(10)
    receiver.close()


def test_capacity_bytes_bounds_the_unread_bytes_and_a_larger_message_goes_alone():
    sender, receiver, _ = _channel(items=100, size=64 << 10)
    big = numpy.zeros(100_000, dtype=numpy.uint8)  # larger than the whole capacity
    thread = _in_thread(lambda: sender.send(big, timeout=10))
    assert receiver.recv(10).nbytes == 100_000
    _joined(thread)
    assert receiver.wait(0.05) == []  # waiting: the credit is back
    sender.send(numpy.zeros(40_000, dtype=numpy.uint8), timeout=10)
    with pytest.raises(TimeoutError):
        sender.send(numpy.zeros(40_000, dtype=numpy.uint8), timeout=0.2)
    assert receiver.recv(10).nbytes == 40_000
    assert receiver.wait(0.05) == []
    sender.send(numpy.zeros(40_000, dtype=numpy.uint8), timeout=10)
    assert receiver.recv(10).nbytes == 40_000
    sender.close()
    receiver.close()


def test_a_sender_full_by_bytes_hears_of_its_room_from_a_receiver_that_read_everything():
    """Credits go back a quarter of the capacity at a time; a sender that waits for room
    with less than that read asks for them, and the receiver answers once it has read up
    to the request (never a sender left waiting on credits the receiver holds)."""
    sender, receiver, _ = _channel(items=100, size=64 << 10)
    small, large = numpy.zeros(10_000, dtype=numpy.uint8), numpy.zeros(60_000, dtype=numpy.uint8)
    thread = _in_thread(lambda: (sender.send(small, timeout=10), sender.send(large, timeout=10)))
    assert receiver.recv(10).nbytes == 10_000  # 10 kB read: below a quarter, no credit yet
    assert receiver.recv(10).nbytes == 60_000  # 10 + 60 kB > 64 kB: sent once credited
    _joined(thread)
    sender.close()
    receiver.close()


def test_a_stream_receiver_waits_with_other_receivers():
    sender_a, receiver_a, _ = _channel()
    sender_b, receiver_b, _ = _channel()
    connect = _in_thread(lambda: (sender_a.send("a"), sender_b.send("b")))
    assert receiver_a.recv(10) == "a" and receiver_b.recv(10) == "b"
    _joined(connect)
    assert wait_readable([receiver_a, receiver_b], 0.05) == []
    late = _in_thread(lambda: sender_b.send("late"))
    assert wait_readable([receiver_a, receiver_b], 10) == [receiver_b]
    assert receiver_b.recv(10) == "late"
    _joined(late)
    for end in (sender_a, sender_b, receiver_a, receiver_b):
        end.close()


# -- strangers ------------------------------------------------------------------------------


def test_a_wrong_secret_is_refused_and_the_peer_still_gets_in():
    sender, receiver, address = _channel()
    stranger = st.StreamSpec(st.new_secret(), 8, 1 << 22, key=sender._spec.key)
    refused = st.refused_connections()
    with pytest.raises(ChannelBroken, match="handshake"):
        st.connect(address, stranger)
    assert st.refused_connections() == refused + 1
    thread = _in_thread(lambda: sender.send("for the peer"))
    assert receiver.recv(10) == "for the peer"
    _joined(thread)
    sender.close()
    receiver.close()


def test_a_listener_that_cannot_prove_the_secret_is_left_before_anything_is_read():
    """Both directions: a connector checks the listener's proof too (a stranger who took
    the port must not feed a receiver)."""
    spec = _spec()
    with socket.create_server(("127.0.0.1", 0)) as impostor:
        thread = _in_thread(lambda: _pretend_to_listen(impostor))
        with pytest.raises(ChannelBroken, match="did not prove"):
            st.connect(impostor.getsockname()[:2], spec)
        _joined(thread)


def _pretend_to_listen(server: socket.socket) -> None:
    with _impostor(server) as conn:
        _until_closed(conn)


def _impostor(server: socket.socket) -> socket.socket:
    """The next connection to ``server``, answered as a listener without the secret would:
    a greeting, then a proof made without it."""
    conn, _ = server.accept()
    conn.settimeout(10)
    conn.sendall(st._MAGIC + os.urandom(32))
    conn.recv(64)
    conn.sendall(os.urandom(32))
    return conn


class _WritesAFile:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _evil_frame(path: str) -> bytes:
    stream = pickle.dumps(_WritesAFile(path), protocol=5)
    frame = struct.pack("<Q", 0) + stream
    return struct.pack("<Q", len(frame)) + frame


def _until_closed(conn: socket.socket) -> None:
    """Read until the other end closes (bounded by the socket's timeout); a close with
    our bytes unread there comes as a reset."""
    conn.settimeout(10)
    try:
        while conn.recv(4096):
            pass
    except ConnectionResetError:
        pass


@pytest.mark.parametrize("manner", ["at once", "after the hello", "as a proof"])
def test_a_pickle_from_a_stranger_is_never_unpickled_and_the_channel_goes_on(tmp_path, manner):
    proof = str(tmp_path / "written by unpickling")
    pickle.loads(pickle.dumps(_WritesAFile(proof))).close()
    assert os.path.exists(proof)  # the payload does what it says, if it is ever unpickled
    path = str(tmp_path / "written")
    sender, receiver, address = _channel()
    refused = st.refused_connections()
    evil = _evil_frame(path)
    with socket.create_connection(address, timeout=10) as conn:
        if manner != "at once":
            conn.recv(40)  # the listener's hello
        if manner == "as a proof":
            evil = evil.ljust(64, b"\0")[:64] + evil  # the proof's place, then more of it
        conn.sendall(evil)
        _until_closed(conn)
    assert st.refused_connections() == refused + 1
    thread = _in_thread(lambda: [sender.send(i) for i in range(3)])
    assert [receiver.recv(10) for _ in range(3)] == [0, 1, 2]
    _joined(thread)
    assert not os.path.exists(path)
    sender.close()
    receiver.close()


def test_a_silent_stranger_is_dropped_after_the_handshake_bound_and_never_holds_up_the_peer(monkeypatch):
    monkeypatch.setattr(st, "HANDSHAKE_SECONDS", 1.0)
    sender, receiver, address = _channel()
    refused = st.refused_connections()
    with socket.create_connection(address, timeout=10) as silent:
        silent.recv(40)  # accepted and waiting for its proof
        thread = _in_thread(lambda: sender.send("served while the stranger stalls"))
        assert receiver.recv(10) == "served while the stranger stalls"
        _joined(thread)
        started = time.monotonic()
        _until_closed(silent)
        assert time.monotonic() - started < 5
    assert st.refused_connections() == refused + 1
    sender.close()
    receiver.close()


# -- a peer that breaks -----------------------------------------------------------------


def _half_a_frame() -> bytes:
    stream = pickle.dumps(list(range(1000)), protocol=5)
    frame = struct.pack("<Q", 0) + stream
    whole = struct.pack("<Q", len(frame)) + frame
    return whole[: len(whole) // 2]


def test_a_stream_cut_in_the_middle_of_a_message_is_a_broken_channel():
    spec = _spec()
    address = st.listen(spec)
    receiver = st.StreamReceiver(spec)
    peer = st.connect(address, spec)  # a sender that proves the secret, then dies mid-message
    peer.setblocking(True)
    peer.sendall(_half_a_frame())
    peer.close()
    with pytest.raises(ChannelBroken, match="without ending the stream"):
        receiver.recv(10)
    with pytest.raises(ChannelBroken):
        receiver.recv(10)  # and stays broken: never a bad item
    receiver.close()


def test_a_message_begun_and_not_continued_breaks_the_channel(monkeypatch):
    monkeypatch.setattr(st, "STALL_SECONDS", 0.5)
    spec = _spec()
    address = st.listen(spec)
    receiver = st.StreamReceiver(spec)
    peer = st.connect(address, spec)
    try:
        peer.setblocking(True)
        peer.sendall(_half_a_frame())
        with pytest.raises(ChannelBroken, match="in the middle of a message"):
            receiver.recv(10)
    finally:
        peer.close()
        receiver.close()


def test_a_receiver_that_closes_breaks_the_senders_next_send():
    sender, receiver, _ = _channel(items=2)
    thread = _in_thread(lambda: sender.send(0))
    assert receiver.recv(10) == 0
    _joined(thread)
    receiver.close()
    with pytest.raises(ChannelBroken):
        for i in range(3):  # the close reaches the sender at its wait for room at the latest
            sender.send(i, timeout=10)
    sender.close()
    with pytest.raises(ChannelClosed):
        sender.send(1)


def test_a_watched_waitable_ends_a_blocked_receive():
    sender, receiver, _ = _channel()
    thread = _in_thread(lambda: sender.send(0))
    assert receiver.recv(10) == 0
    _joined(thread)
    read_end, write_end = os.pipe()
    try:
        receiver.watch(read_end)
        os.close(write_end)  # as a process sentinel does when its process ends
        with pytest.raises(ChannelBroken, match="watched"):
            receiver.recv(10)
    finally:
        os.close(read_end)
        sender.close()
        receiver.close()


def test_a_connector_to_no_listener_is_a_broken_channel():
    spec = _spec()
    address = st.listen(spec)
    st.close_listeners()  # nobody listens there any more
    receiver = st.StreamReceiver(spec, address)
    with pytest.raises(ChannelBroken, match="could not connect"):
        receiver.recv(10)
    receiver.close()


# -- a shared-memory channel handed over a Unix-domain socket (handover.py) ------------------


def _unix_names() -> str:
    with open("/proc/net/unix") as table:
        return table.read()


def _take_and_produce(spec: st.StreamSpec, names, count: int, die: bool) -> None:
    from mprs_plus.transport import handover

    names.send(handover.listen_for_sender(spec))
    sender = handover.take_sender(spec, 30)
    for i in range(count):
        sender.send(i)
    if die:
        os.kill(os.getpid(), 9)  # no close, no exit handlers: as a killed actor
    for i in range(ARRAYS):
        sender.send({"array": numpy.full(300_000, i, dtype=numpy.float64), "i": i})
    sender.close()


def _handed_over(count: int, die: bool = False):
    """A child of no relation to the channel (spawned, given only the spec) that listens
    on a Unix-domain socket, takes the sending end and sends; this process's end."""
    from mprs_plus.transport import handover

    spec = _spec(items=16, size=8 << 20)
    names, child_end = multiprocessing.Pipe(duplex=False)
    child = multiprocessing.get_context("spawn").Process(
        target=_take_and_produce, args=(spec, child_end, count, die), daemon=True
    )
    child.start()
    child_end.close()
    assert names.poll(60), "the child did not listen within 60 s"
    name = names.recv()
    names.close()
    return child, spec, handover.hand_over(name, spec)


def test_a_shared_memory_channel_handed_to_an_unrelated_process_carries_items_and_lends_arrays():
    from mprs_plus.transport import lending

    before = lending()
    child, spec, receiver = _handed_over(500)
    try:
        _read_what_produce_sent(receiver, 500)
    finally:
        child.join(30)
        receiver.release()
    assert child.exitcode == 0
    after = lending()
    assert after.lent > before.lent  # views of the shared lend area, as from a local worker
    assert after.lent + after.copied - before.lent - before.copied == ARRAYS
    assert f"@mprs_plus-{spec.key}" not in _unix_names()  # no socket left, here or there


def test_a_killed_sender_of_a_handed_over_channel_is_a_broken_channel_not_a_hang():
    """This process kept no write end of the data pipe: the child's death is end-of-file."""
    child, _, receiver = _handed_over(3, die=True)
    try:
        assert [receiver.recv(30) for _ in range(3)] == [0, 1, 2]
        start = time.monotonic()
        with pytest.raises(ChannelBroken):
            receiver.recv(30)
        assert time.monotonic() - start < 30
    finally:
        child.join(30)
        receiver.release()
    assert child.exitcode == -9


def test_a_hand_over_without_the_secret_is_refused_and_the_peer_still_gets_in():
    from mprs_plus.transport import handover

    spec = _spec()
    name = handover.listen_for_sender(spec)
    stranger = st.StreamSpec(st.new_secret(), 8, 1 << 22, key=spec.key)
    refused = st.refused_connections()
    with pytest.raises(ChannelBroken, match="handshake"):
        handover.hand_over(name, stranger)
    assert st.refused_connections() == refused + 1
    received = []
    thread = _in_thread(lambda: received.append(handover.hand_over(name, spec)))
    sender = handover.take_sender(spec, 30)
    _joined(thread)
    (receiver,) = received
    sender.send("for the peer")
    assert receiver.recv(10) == "for the peer"
    sender.close()
    with pytest.raises(EndOfStream):
        receiver.recv(10)
    receiver.release()
    assert f"@mprs_plus-{spec.key}" not in _unix_names()


def test_no_descriptor_goes_to_a_process_that_cannot_prove_the_secret():
    """A process that took the channel's name first gets nothing: the proof is checked
    before the memory is sent."""
    from mprs_plus.transport import handover

    spec = _spec()
    name = "\0mprs_plus-" + spec.key
    got: list[int] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as impostor:
        impostor.bind(name)
        impostor.listen(1)
        thread = _in_thread(lambda: _pretend_and_collect(impostor, got))
        with pytest.raises(ChannelBroken, match="did not prove"):
            handover.hand_over(name, spec)
        _joined(thread)
    assert got == []


def _pretend_and_collect(server: socket.socket, got: list[int]) -> None:
    with _impostor(server) as conn:
        while True:
            data, fds, _, _ = socket.recv_fds(conn, 4096, 8)
            got.extend(fds)
            if not data:
                return
