"""Nothing Linux-only without a portable path: each Linux-only call the transport makes is
taken away here (its probe monkeypatched) and the path every other system takes is
forced, on this machine: shared memory without ``memfd_create`` (a POSIX shared-memory
object, or a file), pipes without ``F_SETPIPE_SZ`` or ``/proc``, a fork without
``pipe2``, TCP without ``TCP_USER_TIMEOUT``, the transport's choice without a memfd. (The
fork without ``mremap``: ``tests/test_fork_safety.py``.)

Also the pipe transport's own promises that the rings keep by their shared positions:
both ends report the same figures, and an extent goes back by a message."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest
from transport_peers import Sleeps, filled, wait_until

from mprs_plus.transport import _lend, _memory, pipe, stream
from mprs_plus.transport.pipe import open_pipe_channel
from mprs_plus.transport.shm import open_shm_channel

FORK = multiprocessing.get_context("fork")
ROOT = Path(__file__).resolve().parents[2]
RING = 1 << 20


def _lends_a_view(sender, receiver) -> None:
    """A large buffer arrives as a view of the channel's shared memory, and its extent
    goes back when it is dropped."""
    sender.send(filled(5))
    item = receiver.recv(timeout=30)
    assert (item == 5).all() and not item.flags.owndata
    assert sender.lent_extents() > 0
    del item
    assert sender.lent_extents() == 0


@pytest.mark.parametrize(
    "absent, kind",
    [(["memfd_create"], "shm"), (["memfd_create", "shm_open"], "file")],
    ids=["no memfd", "no memfd, no shm_open"],
)
def test_without_a_memfd_the_lend_area_is_an_unlinked_shm_object_or_file(monkeypatch, absent, kind):
    monkeypatch.delattr(os, "memfd_create")
    if "shm_open" in absent:
        monkeypatch.setattr(_memory, "_posixshmem", None)
    assert _memory.memory_kinds()[0] == kind
    fd, made = _memory.anonymous_file("probe", _memory.PAGE)
    try:
        assert made == kind and os.fstat(fd).st_nlink == 0  # no name reaches it
        assert not os.get_inheritable(fd)
    finally:
        os.close(fd)
    sender, receiver = open_pipe_channel(FORK, capacity_items=4, capacity_bytes=RING)
    try:
        _lends_a_view(sender, receiver)
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("kind", _memory.MEMORY_KINDS)
def test_the_kind_of_shared_memory_can_be_forced_for_both_transports(monkeypatch, kind):
    monkeypatch.setenv("MPRS_PLUS_LEND_MEMORY", kind)
    assert _memory.memory_kinds() == [kind]
    for opener in (open_pipe_channel, open_shm_channel):
        sender, receiver = opener(FORK, capacity_items=4, capacity_bytes=RING)
        try:
            _lends_a_view(sender, receiver)
        finally:
            sender.close()
            receiver.close()


def test_a_kind_of_shared_memory_the_system_lacks_or_a_misspelt_one_is_refused(monkeypatch):
    monkeypatch.setenv("MPRS_PLUS_LEND_MEMORY", "memfd")
    monkeypatch.delattr(os, "memfd_create")
    with pytest.raises(RuntimeError, match="no memfd"):
        _memory.memory_kinds()
    monkeypatch.setenv("MPRS_PLUS_LEND_MEMORY", "hugepages")
    with pytest.raises(ValueError, match="MPRS_PLUS_LEND_MEMORY must be"):
        _memory.memory_kinds()


def test_without_a_memfd_the_pipe_transport_is_chosen():
    script = (
        "import os; del os.memfd_create\n"
        "import mprs_plus.transport as t\n"
        "assert t.TRANSPORT == 'pipe', t.TRANSPORT\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MPRS_PLUS_TRANSPORT"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, check=True, timeout=120)


def _kernel_buffer(fd: int) -> int | None:
    import fcntl

    getsize = getattr(fcntl, "F_GETPIPE_SZ", None)
    return None if getsize is None else fcntl.fcntl(fd, getsize)


def test_without_f_setpipe_sz_a_sender_waits_for_the_kernel_as_a_sleep(monkeypatch):
    """The kernel's buffer (64 KiB) then bounds before the credits (1 MiB): the sender
    waits for it in a reported sleep, and every message arrives whole and in order."""
    import fcntl

    monkeypatch.setattr(pipe, "fcntl", types.SimpleNamespace(fcntl=fcntl.fcntl))  # no F_SETPIPE_SZ
    sender, receiver = open_pipe_channel(FORK, capacity_items=16, capacity_bytes=RING)
    items = [bytes([i]) * (100 << 10) for i in range(6)]  # in the pickle: through the pipe
    asleep = Sleeps()

    def send_all() -> None:
        with asleep:
            for item in items:
                sender.send(item)

    thread = threading.Thread(target=send_all)
    try:
        if _kernel_buffer(sender._conn.fileno()) is not None:
            assert _kernel_buffer(sender._conn.fileno()) < sum(map(len, items))
        thread.start()
        wait_until(asleep)  # held up by the kernel's buffer, not by the credits
        assert [receiver.recv(timeout=30) for _ in items] == items
        thread.join(30)
        assert not thread.is_alive()
    finally:
        sender.close()
        receiver.close()


def test_without_proc_a_refused_kernel_buffer_is_left_as_it_is(monkeypatch):
    calls = []

    def refusing(fd, command, value=0):
        calls.append(value)
        raise PermissionError("over the system's limit")

    monkeypatch.setattr(pipe, "fcntl", types.SimpleNamespace(fcntl=refusing, F_SETPIPE_SZ=1031))
    monkeypatch.setattr(pipe, "PIPE_MAX_SIZE", "/nonexistent/pipe-max-size")
    sender, receiver = open_pipe_channel(FORK, capacity_items=4, capacity_bytes=RING)
    try:
        assert len(calls) == 1  # asked once; the limit could not be read, so not again
        sender.send("fine")
        assert receiver.recv(timeout=30) == "fine"
    finally:
        sender.close()
        receiver.close()


def test_without_pipe2_a_fork_while_buffers_are_lent_keeps_the_childs_bytes(monkeypatch):
    monkeypatch.delattr(os, "pipe2")
    read_end, write_end = _lend._fork_pipe()
    try:
        assert not os.get_blocking(read_end) and not os.get_blocking(write_end)
        assert not os.get_inheritable(read_end) and not os.get_inheritable(write_end)
    finally:
        os.close(read_end)
        os.close(write_end)
    sender, receiver = open_pipe_channel(FORK, capacity_items=4, capacity_bytes=RING)
    try:
        sender.send(filled(1))
        held = receiver.recv(timeout=30)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 0 if (held == 1).all() else 3
            held[:] = 9  # private to the child
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert (held == 1).all(), "the child's write reached the parent"
        del held
        for i in range(2, 3 * _lend.LEND_FACTOR * RING // len(filled(0))):  # cycles the area
            sender.send(filled(i))
            assert (receiver.recv(timeout=30) == i % 251).all()
    finally:
        sender.close()
        receiver.close()


def test_without_tcp_user_timeout_a_stream_socket_is_tuned_all_the_same(monkeypatch):
    monkeypatch.delattr(socket, "TCP_USER_TIMEOUT", raising=False)
    server = socket.create_server(("127.0.0.1", 0))
    try:
        client = socket.create_connection(server.getsockname(), timeout=30)
        accepted, _ = server.accept()
        try:
            stream._tune(client)
            assert client.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
            assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        finally:
            client.close()
            accepted.close()
    finally:
        server.close()


@pytest.mark.parametrize("opener", [open_pipe_channel, open_shm_channel], ids=["pipe", "shm"])
def test_both_ends_report_what_the_channel_holds(opener):
    """A reader waiting for one channel learns what another holds from its receiver (the
    runtime's stuck-read check does): the same figures at both ends, on both transports."""
    sender, receiver = opener(FORK, capacity_items=8, capacity_bytes=RING)
    try:
        for i in range(3):
            sender.send(i)
        sender.send(filled(0))  # lent: its bytes count too
        sent = sender.traffic()
        assert receiver.traffic() == sent
        assert sent.messages == 4 and sent.queued_messages == 4 and sent.bytes > len(filled(0))
        assert receiver.recv(timeout=30) == 0
        assert receiver.traffic().queued_messages == 3 == sender.traffic().queued_messages
    finally:
        sender.close()
        receiver.close()


def test_an_extent_given_back_by_message_is_lent_again_only_once_it_arrived():
    """The pipe's receiver gives an extent back by a message on the credit pipe: until the
    sender has read it, the extent stays lent, and a message split across two reads is
    still understood."""
    sender, receiver = open_pipe_channel(FORK, capacity_items=64, capacity_bytes=RING)
    try:
        sender.send(filled(1))
        item = receiver.recv(timeout=30)
        assert sender.lent_extents() == len(filled(0))
        del item  # [RELEASE, slot] is in the credit pipe now
        first = os.read(sender._credits.fileno(), 1)  # the release's first byte alone
        sender._take_releases(first)  # as if a read had ended in the middle of the release
        assert sender._release_pending
        assert sender.lent_extents() == 0  # the slot's byte came with the next read
        sender.send(filled(2))
        assert (receiver.recv(timeout=30) == 2).all()
    finally:
        sender.close()
        receiver.close()


def test_a_large_array_through_a_pipe_channel_handed_to_a_spawned_child():
    ctx = multiprocessing.get_context("spawn")
    sender, receiver = open_pipe_channel(ctx, capacity_items=4, capacity_bytes=RING)
    from transport_peers import send_filled

    process = ctx.Process(target=send_filled, args=(sender, 20, 256 << 10))
    process.start()
    sender.release()
    try:
        got = [receiver.recv(timeout=60) for _ in range(20)]
        assert all((a == i % 251).all() and not a.flags.owndata for i, a in enumerate(got))
        assert all(isinstance(a, np.ndarray) for a in got)
    finally:
        receiver.close()
        process.join(60)
    assert process.exitcode == 0
