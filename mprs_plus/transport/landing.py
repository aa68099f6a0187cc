"""A stream from another host lands in this host's shared memory: a small process of this
host reads the socket and writes each message into a shared-memory channel, so the process
that reads it (the training process) reads a ring and a lend area, as from a local peer,
and never copies a byte out of a socket.

    remote sender ==== TCP (stream.py, proved) ====> landing process (this host)
                                                       recv_encoded: frames, not unpickled
                                                       send_encoded  ----> shared-memory ring
                                                                            + lend area
                                                     reading process <---- ShmReceiver

Why a process: the kernel's copy out of a socket costs the reader about as much CPU per
byte as a memcpy (hundreds of microseconds per MiB), and the reader is the training loop.
Ray's object manager moves a cluster's objects for the same reason in a process other than
the driver. The landing process forwards frames as they are: it never unpickles one (the
stream proved the secret before any byte of it was read; the reader unpickles, as it would
have). It imports only this transport, so it starts in tens of milliseconds.

The landing process's life, and every way it ends:

    what happens                          what it does                 the reader sees
    the stream ends (end of stream)       closes the ring, exits 0     EndOfStream
    the stream breaks (peer died, a cut,  writes why on its status     ChannelBroken
    a bad frame, no proof)                pipe, exits 3 without         (``problem()``: why)
                                          closing the ring
    the reader closes its end             sees it at its next send or  -
                                          within ``RECHECK_SECONDS``;
                                          exits 0
    ``stop()`` (the reader's process       end of file on its stop      -
    stops it, or dies: SIGKILL too)       pipe, which every wait of
                                          it watches; exits 0
    it is killed                          -                            ChannelBroken (end of
                                                                        file on the ring's
                                                                        data pipe)

``stop()`` waits for it at most ``STOP_SECONDS`` and then kills it: it never outlives the
stop. Capacities: the ring holds ``capacity_items`` / ``capacity_bytes`` as the stream
does, so up to twice those are between the two processes (one hop each).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref
from collections.abc import Sequence
from typing import Any

from ._ring import close_fds
from ._sender import ShmSender
from .channel import RECHECK_SECONDS, poll_waitables
from .errors import ChannelBroken, EndOfStream
from .shm import ShmReceiver, open_shm_channel
from .stream import Address, StreamReceiver, StreamSpec

STOP_SECONDS = 2.0  # a stop waits this long for the process to end, then kills it
BROKEN = 3  # the exit status of a landing process whose stream broke
_STATUS_BYTES = 4096  # the most of a reason read back


class Landing:
    """The reading process's side: the landing process of one stream, and the receiving
    end of its ring. ``start`` makes both; ``receiver`` is read like any ``ShmReceiver``."""

    def __init__(self, process: subprocess.Popen[bytes], receiver: ShmReceiver, stop_fd: int, status_fd: int) -> None:
        self.process = process
        self.receiver = receiver
        self._stop_fd = stop_fd  # its write end: closed, the landing process ends
        self._status_fd = status_fd  # why its stream broke, written before it exits
        self._owner = os.getpid()
        self._reason: str | None = None
        _running.add(self)

    def _forget(self) -> None:
        """In a forked child of the reader: close this copy's pipe ends, so that the
        landing process still ends when the reader stops it (the child's copy of the stop
        pipe would otherwise keep it open)."""
        self._close("_stop_fd")
        self._close("_status_fd")

    def _close(self, name: str) -> None:
        """Close the pipe end held in attribute ``name``, once."""
        fd = getattr(self, name)
        setattr(self, name, -1)
        if fd >= 0:
            close_fds([fd])

    @classmethod
    def start(cls, address: Address, spec: StreamSpec, watched: Sequence[Any] = ()) -> Landing:
        """A landing process that connects to the listening sender of ``spec`` at
        ``address`` and lands its messages in a new shared-memory channel of ``spec``'s
        capacities; ``watched`` waitables (the sender's process sentinel) end the reader's
        waits as for any channel."""
        sender, receiver = open_shm_channel(None, capacity_items=spec.capacity_items, capacity_bytes=spec.capacity_bytes)
        stop_r, stop_w = os.pipe()
        status_r, status_w = os.pipe()
        sizes, ring_fds = sender.descriptors()
        config = {
            "host": address[0],
            "port": address[1],
            "key": spec.key,
            "secret": spec.secret.hex(),
            "capacity_items": spec.capacity_items,
            "capacity_bytes": spec.capacity_bytes,
            "ring": [sizes, ring_fds],
            "stop": stop_r,
            "status": status_w,
        }
        process = None
        try:
            # The configuration (the secret with it) goes through a pipe: a command line is
            # readable by every user of the host.
            process = subprocess.Popen(
                [sys.executable, "-m", __name__],
                stdin=subprocess.PIPE,
                pass_fds=(*ring_fds, stop_r, status_w),
                env=_env_finding_this_package(),
                close_fds=True,
            )
            assert process.stdin is not None
            with process.stdin:
                process.stdin.write(json.dumps(config).encode())
        except BaseException:
            receiver.release()
            close_fds([stop_w, status_r])
            if process is not None:
                process.kill()
                process.wait()
            raise
        finally:
            # The landing process holds them now; the sending end is its alone, so that its
            # death is end of file on the ring's data pipe here.
            sender.release()
            close_fds([stop_r, status_w])
        os.set_blocking(status_r, False)
        receiver.watch(*watched)
        return cls(process, receiver, stop_w, status_r)

    def problem(self) -> str | None:
        """Why the landing process ended early, once it has: what it said of its broken
        stream, else its exit status when not 0; None while it runs or after a clean end."""
        code = self.process.poll()
        if self._reason is None and code is not None:
            self._reason = self._read_status()
            if not self._reason and code != 0:
                self._reason = f"the landing process of this stream (pid {self.process.pid}) ended with exit status {code}"
        return self._reason or None

    def request_stop(self) -> None:
        """Tell the landing process to end (end of file on its stop pipe), without
        waiting: a reader with many streams asks them all, then waits for each."""
        self._close("_stop_fd")

    def stop(self) -> None:
        """``request_stop``, then wait at most ``STOP_SECONDS`` for the landing process
        to end, then kill it; never raises. In a process that did not start it (a fork of
        the reader), only this copy's descriptors are closed."""
        self.request_stop()
        if os.getpid() == self._owner:
            try:
                self.process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
                try:
                    self.process.wait(STOP_SECONDS)
                except subprocess.TimeoutExpired:
                    pass  # a process the kernel has not reaped in 2 s after SIGKILL: left to init
            self.problem()
        self._close("_status_fd")

    def _read_status(self) -> str:
        if self._status_fd < 0:
            return ""
        try:
            return os.read(self._status_fd, _STATUS_BYTES).decode("utf-8", "replace").strip()
        except OSError:
            return ""


_running: weakref.WeakSet[Landing] = weakref.WeakSet()


def _forget_all_in_child() -> None:
    for landing in list(_running):
        landing._forget()


os.register_at_fork(after_in_child=_forget_all_in_child)


def _env_finding_this_package() -> dict[str, str]:
    """This environment, with the directory holding this package first on PYTHONPATH: the
    landing process imports it by name, wherever the reader found it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


# -- the landing process ------------------------------------------------------------------


def run(config: dict[str, Any]) -> int:
    """The landing process's loop; its exit status."""
    stop_fd, status_fd = config["stop"], config["status"]
    spec = StreamSpec(
        bytes.fromhex(config["secret"]),
        config["capacity_items"],
        config["capacity_bytes"],
        key=config["key"],
    )
    ring = ShmSender.from_descriptors(*config["ring"])
    ring.watch(stop_fd)
    stream = StreamReceiver(spec, (config["host"], config["port"]))
    stream.watch(stop_fd)

    def stopped() -> bool:
        return bool(poll_waitables([stop_fd], 0))

    scratch = _Scratch()
    try:
        while True:
            scratch.reuse()  # the last message's buffers are in the ring now
            try:
                stream_bytes, buffers = stream.recv_encoded(RECHECK_SECONDS, scratch.take)
            except TimeoutError:
                if ring.receiver_closed() or stopped():
                    return 0
                continue
            except EndOfStream:
                ring.close()
                return 0
            except ChannelBroken as exc:
                if stopped():
                    return 0
                _say(status_fd, str(exc))
                return BROKEN
            try:
                ring.send_encoded(stream_bytes, [memoryview(b) for b in buffers])
            except ChannelBroken:
                return 0  # the reader closed its end, or is gone, or stopped this process
    finally:
        stream.release()
        ring.release()


class _Scratch:
    """The landing process's receive buffers, used again for the next messages: a fresh
    megabyte costs the kernel a page fault per page, more than receiving into it."""

    KEEP = 64 << 20  # bytes of buffers kept for reuse, at most

    def __init__(self) -> None:
        self._free: dict[int, list[bytearray]] = {}
        self._used: list[bytearray] = []
        self._kept = 0  # bytes in ``_free``

    def take(self, nbytes: int) -> bytearray:
        found = self._free.get(nbytes)
        if found:
            buffer = found.pop()
            self._kept -= nbytes
        else:
            buffer = bytearray(nbytes)
        self._used.append(buffer)
        return buffer

    def reuse(self) -> None:
        """Every buffer taken since the last call is free again (kept within ``KEEP``)."""
        for buffer in self._used:
            if self._kept + len(buffer) <= self.KEEP:
                self._free.setdefault(len(buffer), []).append(buffer)
                self._kept += len(buffer)
        self._used.clear()


def _say(fd: int, why: str) -> None:
    try:
        os.write(fd, why.encode("utf-8", "replace")[:_STATUS_BYTES])
    except OSError:
        pass  # the reader is gone: nobody to tell


def main() -> int:
    config = json.loads(sys.stdin.buffer.read())
    try:
        return run(config)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
