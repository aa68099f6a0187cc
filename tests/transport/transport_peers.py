"""Bodies of the child processes the transport tests start (module level, so that spawn
and forkserver children can import them), and a helper to wait on shared state."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from mprs_plus.transport import TRANSPORT, EndOfStream, note_blocking, release_all_except
from mprs_plus.transport import _ring


# Tests that look inside the shared-memory rings (positions, sleeping flags) run only
# when that transport is in use (MPRS_PLUS_TRANSPORT selects it; see the transport package).
shm_only = pytest.mark.skipif(TRANSPORT != "shm", reason="looks inside the shared-memory transport")


def wait_until(predicate: Callable[[], Any], timeout: float = 30.0) -> None:
    """Spin (yielding the CPU) until ``predicate()`` holds; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout} s")
        os.sched_yield()


class Sleeps:
    """Whether a thread is asleep in a channel wait now, as every transport reports it
    through ``note_blocking`` (the interface the runtime's stuck-read check uses). Install
    it in the thread that is to wait (``with Sleeps() as asleep:``, or ``note_blocking(
    asleep.note)`` in a child that was handed it), then ask ``asleep()`` from any thread or
    process."""

    def __init__(self, ctx: Any = None) -> None:
        self._since = (ctx or multiprocessing.get_context("fork")).RawValue("d", 0.0)

    def note(self, since: float) -> None:
        self._since.value = since

    def __call__(self) -> bool:
        return self._since.value > 0.0

    def __enter__(self) -> Sleeps:
        note_blocking(self.note)
        return self

    def __exit__(self, *exc: Any) -> None:
        note_blocking(None)


def ring_sender_sleeps(receiver: Any) -> bool:
    """A ring's producer is blocked waiting for room (its flag in the ring's control page,
    cleared by the receiver's read that wakes it): for tests of the ring's own backpressure."""
    return bool(receiver._ctl[_ring.TX_SLEEPING])


def echo(receiver: Any, sender: Any) -> None:
    """Send back everything received; end the stream when the input ends."""
    release_all_except([receiver, sender])
    try:
        while True:
            sender.send(receiver.recv())
    except EndOfStream:
        sender.close()


def produce(sender: Any, items: list[Any], counter: Any = None, close: bool = True, asleep: Sleeps | None = None) -> None:
    """Send ``items``, counting each accepted one in ``counter`` (a shared Value), its
    sleeps reported to ``asleep``."""
    release_all_except([sender])
    if asleep is not None:
        note_blocking(asleep.note)
    for item in items:
        sender.send(item)
        if counter is not None:
            with counter.get_lock():
                counter.value += 1
    if close:
        sender.close()
    else:
        os._exit(0)  # die without ending the stream


def hold(endpoint: Any) -> None:
    """Own ``endpoint`` and never use it (until killed)."""
    release_all_except([endpoint])
    threading.Event().wait()


def descriptor_identities(fds: Any = None) -> set[tuple[int, int, int]]:
    """(device, inode, access mode) of each descriptor: which file, and which end of a pipe."""
    if fds is None:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    found = set()
    for fd in fds:
        try:
            info = os.fstat(fd)
            found.add((info.st_dev, info.st_ino, fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE))
        except OSError:
            continue  # the listing's own descriptor, closed already
    return found


def list_fds(sender: Any, report: Any) -> None:
    """Report the descriptors this (forked) child holds after dropping foreign endpoints."""
    release_all_except([sender])
    report.send(descriptor_identities())
    report.close()
    sender.send("alive")
    os._exit(0)  # without close(): the reader must see a broken stream


def _explode(message: str) -> None:
    raise RuntimeError(message)


class FailsToUnpickle:
    def __reduce__(self) -> tuple[Any, ...]:
        return _explode, ("cannot rebuild this",)


class ExitsWhilePickling:
    def __reduce__(self) -> tuple[Any, ...]:
        os._exit(3)


def filled(value: int, nbytes: int = 256 << 10) -> Any:
    """A uint8 array of ``nbytes`` (by default large enough to be lent) filled with
    ``value % 251``: an item whose every byte says which it is."""
    import numpy

    return numpy.full(nbytes, value % 251, dtype=numpy.uint8)


def send_filled(sender: Any, count: int, nbytes: int, extra: Any = None) -> None:
    """Send ``count`` uint8 arrays of ``nbytes``, array ``i`` filled with ``i % 251``
    (with ``extra`` beside each when given), then end the stream."""
    release_all_except([sender])
    for i in range(count):
        array = filled(i, nbytes)
        sender.send(array if extra is None else (extra, array))
    sender.close()


def drop_inherited_lent_buffers() -> None:
    """In a forked child: let every lent buffer the child inherited die (as when a child
    collects garbage it inherited), then exit."""
    from mprs_plus.transport import _lend

    for ref, *_ in list(_lend._holding.roots.values()):
        _lend._give_back(ref)
    os._exit(0)
