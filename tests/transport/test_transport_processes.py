"""Channels between processes: every start method, peers killed at the worst moment,
forked children dropping what they inherit, and nothing left behind."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from transport_peers import (
    ExitsWhilePickling,
    descriptor_identities,
    echo,
    hold,
    list_fds,
    produce,
    shm_only,
    Sleeps,
    wait_until,
)

import mprs_plus.runtime  # noqa: F401  (registers the tensor reducer)
from mprs_plus.transport import ChannelBroken, EndOfStream, _wakeup, open_channel

FORK = multiprocessing.get_context("fork")
ROOT = Path(__file__).resolve().parents[2]


def _fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


def _shm_names() -> set[str]:
    """Named segments this test could have made and can tell apart: ours, or torch's (named
    after the process that made them; ``_made_here``). multiprocessing.shared_memory's
    ``psm_`` names say nothing of their maker, and other processes on the machine make them
    meanwhile (a second test suite's SPDL pool did, and failed this test), so they are not
    counted; the transport's own segments are memfds, gone with their last descriptor,
    which the descriptor check covers."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(("mprs", "torch_"))}


def _made_here(names: set[str], pids: set[int]) -> set[str]:
    # torch names its segments torch_<pid>_...; anything else of those prefixes is ours.
    return {name for name in names if not name.startswith("torch_") or int(name.split("_")[1]) in pids}


def _start(ctx, target, *args):
    process = ctx.Process(target=target, args=args, daemon=True)
    process.start()
    return process


def _kill_when(predicate, process) -> threading.Thread:
    """SIGKILL ``process`` as soon as ``predicate()`` holds (from a helper thread)."""

    def run() -> None:
        wait_until(predicate)
        os.kill(process.pid, signal.SIGKILL)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_echo_through_a_child_with_every_start_method(start_method):
    ctx = multiprocessing.get_context(start_method)
    to_child, child_in = open_channel(ctx, capacity_items=4, capacity_bytes=1 << 20)
    child_out, from_child = open_channel(ctx, capacity_items=4, capacity_bytes=1 << 20)
    process = _start(ctx, echo, child_in, child_out)
    child_in.release()
    child_out.release()
    from_child.watch(process.sentinel)
    to_child.watch(process.sentinel)
    values = [
        1,
        "two",
        np.arange(100_000, dtype=np.float32).reshape(100, 1000),
        torch.randn(64, 64).t(),
        {"batch": torch.arange(10), "big": bytearray(3 << 20)},  # larger than the ring
        torch.tensor(7),
    ]
    try:
        for value in values:
            to_child.send(value)
            out = from_child.recv(timeout=60)
            if isinstance(value, np.ndarray):
                assert np.array_equal(out, value)
            elif isinstance(value, torch.Tensor):
                assert torch.equal(out, value) and out.stride() == value.stride()
            elif isinstance(value, dict):
                assert torch.equal(out["batch"], value["batch"]) and out["big"] == value["big"]
            else:
                assert out == value
        to_child.close()
        with pytest.raises(EndOfStream):
            from_child.recv(timeout=60)
    finally:
        to_child.close()
        from_child.close()
        process.join(30)
    assert process.exitcode == 0


def test_recv_breaks_when_the_sender_is_killed_while_it_waits(start_method):
    ctx = multiprocessing.get_context(start_method)
    sender, receiver = open_channel(ctx, capacity_items=4, capacity_bytes=1 << 20)
    process = _start(ctx, hold, sender)
    sender.release()
    asleep = Sleeps()
    killer = _kill_when(asleep, process)  # once this thread sleeps in the channel's wait
    try:
        with asleep, pytest.raises(ChannelBroken, match="sending process is gone"):
            receiver.recv(timeout=60)
    finally:
        killer.join(30)
        receiver.close()
        process.join(30)


def test_send_breaks_when_the_receiver_is_killed_while_it_waits(start_method):
    ctx = multiprocessing.get_context(start_method)
    sender, receiver = open_channel(ctx, capacity_items=2, capacity_bytes=1 << 20)
    process = _start(ctx, hold, receiver)
    receiver.release()
    asleep = Sleeps()
    killer = _kill_when(asleep, process)  # once this thread sleeps in the channel's wait
    try:
        with asleep, pytest.raises(ChannelBroken, match="receiving process is gone"):
            for i in range(10):
                sender.send(i)
    finally:
        killer.join(30)
        sender.close()
        process.join(30)


def test_a_watched_process_ending_breaks_a_blocked_recv():
    sender, receiver = open_channel(FORK, capacity_items=2, capacity_bytes=1 << 20)
    bystander = _start(FORK, hold, None)
    receiver.watch(bystander.sentinel)
    asleep = Sleeps()
    killer = _kill_when(asleep, bystander)  # once this thread sleeps in the channel's wait
    try:
        with asleep, pytest.raises(ChannelBroken, match="watched"):
            receiver.recv(timeout=60)
    finally:
        killer.join(30)
        sender.close()
        receiver.close()
        bystander.join(30)


def test_a_sender_killed_in_the_middle_of_a_big_message_breaks_the_receiver():
    sender, receiver = open_channel(FORK, capacity_items=2, capacity_bytes=1)  # 64 KiB ring
    process = _start(FORK, produce, sender, ["small", bytearray(1 << 20)])
    sender.release()
    assert receiver.recv(timeout=60) == "small"
    # The big message has begun: it cannot end (it is too large for the lend area, and
    # far larger than the channel) until this end reads, so the sender is mid-message.
    wait_until(receiver.poll)
    os.kill(process.pid, signal.SIGKILL)
    process.join(30)
    try:
        with pytest.raises(ChannelBroken, match="middle of a message"):
            receiver.recv(timeout=60)
    finally:
        receiver.close()


def test_a_sender_that_exits_while_pickling_breaks_the_receiver():
    sender, receiver = open_channel(FORK, capacity_items=10, capacity_bytes=1 << 20)
    process = _start(FORK, produce, sender, ["first", ExitsWhilePickling(), "never"])
    sender.release()
    try:
        assert receiver.recv(timeout=30) == "first"
        with pytest.raises(ChannelBroken, match="sending process is gone"):
            receiver.recv(timeout=30)
    finally:
        receiver.close()
        process.join(30)
    assert process.exitcode == 3


def test_messages_sent_before_the_sender_died_are_still_delivered():
    sender, receiver = open_channel(FORK, capacity_items=10, capacity_bytes=1 << 20)
    process = _start(FORK, produce, sender, [1, 2, 3], None, False)
    sender.release()
    process.join(30)
    assert [receiver.recv(timeout=30) for _ in range(3)] == [1, 2, 3]
    assert receiver.poll()
    with pytest.raises(ChannelBroken):
        receiver.recv(timeout=30)
    receiver.close()


def test_release_all_except_in_a_forked_child():
    # A dead peer shows only once every copy of its descriptors is closed, so each check
    # below would hang if the child had kept a copy of an endpoint it does not own.
    mine_tx, mine_rx = open_channel(FORK, capacity_items=4, capacity_bytes=1 << 20)
    other_tx, other_rx = open_channel(FORK, capacity_items=1, capacity_bytes=1 << 20)
    third_tx, third_rx = open_channel(FORK, capacity_items=1, capacity_bytes=1 << 20)
    process = _start(FORK, produce, mine_tx, ["alive"], None, False)
    mine_tx.release()
    try:
        assert mine_rx.recv(timeout=30) == "alive"
        with pytest.raises(ChannelBroken):  # it died without close(): nobody else writes
            mine_rx.recv(timeout=30)
        other_tx.release()  # the child dropped its copy of this sender...
        with pytest.raises(ChannelBroken):
            other_rx.recv(timeout=30)
        third_rx.release()  # ... and of this receiver
        with pytest.raises(ChannelBroken, match="receiving process is gone"):
            for i in range(3):
                third_tx.send(i)
    finally:
        process.join(30)
        for end in (mine_rx, other_rx, third_tx):
            end.close()


@shm_only  # names the ring's descriptors
def test_a_forked_child_closes_the_descriptors_it_does_not_own():
    kept_tx, kept_rx = open_channel(FORK, capacity_items=4, capacity_bytes=1 << 20)
    other_tx, other_rx = open_channel(FORK, capacity_items=4, capacity_bytes=1 << 20)
    report_rx, report_tx = FORK.Pipe(duplex=False)
    process = _start(FORK, list_fds, kept_tx, report_tx)
    report_tx.close()
    kept_tx_fds = (kept_tx._wait_fd, kept_tx._signal_fd)
    own = descriptor_identities(kept_tx_fds)  # before this process lets go of them
    kept_tx.release()
    try:
        held = report_rx.recv()
        foreign = descriptor_identities(
            [other_tx._wait_fd, other_tx._signal_fd, other_rx._wait_fd, other_rx._signal_fd, other_rx._region.fd]
            + [kept_rx._wait_fd, kept_rx._signal_fd]
        )
        own |= descriptor_identities([kept_rx._region.fd])
        assert not foreign & held, "the child kept descriptors of endpoints it does not own"
        assert own <= held
        assert kept_rx.recv(timeout=30) == "alive"
    finally:
        process.join(30)
        report_rx.close()
        for end in (kept_rx, other_tx, other_rx):
            end.close()


def test_no_lost_wake_up_when_both_sides_sleep_every_time(monkeypatch):
    # Without spinning every wait goes to sleep, so the flag/fence/pipe handshake runs
    # for nearly every message in both directions; a lost wake-up would hang (and time out).
    monkeypatch.setattr(_wakeup, "SPIN_SECONDS", 0.0)
    sender, receiver = open_channel(FORK, capacity_items=1, capacity_bytes=1)
    process = _start(FORK, produce, sender, list(range(3000)))
    sender.release()
    try:
        assert [receiver.recv(timeout=60) for _ in range(3000)] == list(range(3000))
        with pytest.raises(EndOfStream):
            receiver.recv(timeout=60)
    finally:
        receiver.close()
        process.join(30)


# -- nothing left behind ------------------------------------------------------------------


def test_no_descriptor_or_segment_is_left_behind(start_method):
    ctx = multiprocessing.get_context(start_method)
    # Warm up: the first start of a method may open descriptors that live on by design
    # (the forkserver, the resource tracker).
    test_echo_through_a_child_with_every_start_method(start_method)
    multiprocessing.active_children()  # forget finished children, whose pipes close then
    gc.collect()
    fds_before, shm_before = _fds(), _shm_names()
    pids = {os.getpid()}
    for _ in range(2):
        to_child, child_in = open_channel(ctx, capacity_items=4, capacity_bytes=1 << 20)
        child_out, from_child = open_channel(ctx, capacity_items=4, capacity_bytes=1 << 20)
        process = _start(ctx, echo, child_in, child_out)
        pids.add(process.pid)
        child_in.release()
        child_out.release()
        to_child.send(np.ones(100_000))
        from_child.recv(timeout=60)
        os.kill(process.pid, signal.SIGKILL)  # a crash, not a clean exit
        process.join(30)
        process.close()
        with pytest.raises(ChannelBroken):
            from_child.recv(timeout=60)
        to_child.close()
        from_child.close()
    # Dropped without close() or release(): the finalizer closes the descriptors.
    dropped = open_channel(ctx, capacity_items=1, capacity_bytes=1)
    del dropped
    multiprocessing.active_children()
    gc.collect()
    assert _fds() == fds_before
    assert not _made_here(_shm_names() - shm_before, pids)


_SPAWN_SCRIPT = textwrap.dedent(
    """
    import multiprocessing, os, signal
    import numpy as np
    import mprs_plus.runtime
    from mprs_plus.transport import open_channel
    import transport_peers

    if __name__ == "__main__":
        ctx = multiprocessing.get_context("spawn")
        to_child, child_in = open_channel(ctx, capacity_items=4, capacity_bytes=1 << 20)
        child_out, from_child = open_channel(ctx, capacity_items=4, capacity_bytes=1 << 20)
        process = ctx.Process(target=transport_peers.echo, args=(child_in, child_out))
        process.start()
        child_in.release()
        child_out.release()
        to_child.send(np.ones(300_000))
        assert from_child.recv(timeout=60).sum() == 300_000
        to_child.close()
        process.join(30)
        tx, rx = open_channel(ctx, capacity_items=1, capacity_bytes=1)
        victim = ctx.Process(target=transport_peers.hold, args=(rx,))
        victim.start()
        rx.release()
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(30)
        print("done")
    """
)


def test_spawned_children_leave_no_resource_tracker_warning(tmp_path):
    script = tmp_path / "spawn_case.py"
    script.write_text(_SPAWN_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(Path(__file__).parent)]))
    shm_before = _shm_names()
    result = subprocess.run(
        [sys.executable, "-W", "ignore::UserWarning", str(script)],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "done"
    assert "resource_tracker" not in result.stderr and "leaked" not in result.stderr, result.stderr
    assert not [name for name in _shm_names() - shm_before if not name.startswith("torch_")]
