"""Process lifecycle: what every child does first, and how the main process ends them.

Children
    * ignore SIGINT: Ctrl-C reaches the whole process group, but only the main process
      decides to stop; children then end when their control channel closes, instead
      of printing tracebacks;
    * watch their parent: a daemon thread waits on the parent's sentinel and exits the
      child at once when the parent is gone, so a killed main process leaves no orphans;
    * drop inherited channel endpoints they do not own (fork), so that a dead peer
      shows as a broken pipe.

Main process
    ``stop_processes`` asks nicely (the caller already closed the control channels, which
    is the children's STOP), then escalates join -> terminate -> kill, each step bounded:
    it returns within ``STOP_GRACE`` plus a fraction of a second whatever the children
    do (a child stopped by SIGSTOP ignores SIGTERM until killed). ``stop_at_exit``
    registers, when the first service starts, an exit hook that stops every service still
    running; being registered after ``multiprocessing`` set up its own, it runs before the
    interpreter joins or terminates child processes.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import weakref
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.connection import wait
from typing import Any

from ..errors import ProcessDiedError
from ..transport import release_all_except


STOP_GRACE = 5.0  # seconds children get to exit on their own once asked
_TERMINATE_WAIT = 0.25  # SIGTERM kills at once unless the child is stopped (then SIGKILL does)
_KILL_WAIT = 2.0
DEATH_GRACE = 2.0  # seconds a process whose channel broke may take to be reaped

_running: weakref.WeakSet[Any] = weakref.WeakSet()
_hook_registered = False


def stop_at_exit(resources: Any) -> None:
    """Stop ``resources`` (anything with ``stop()``) at interpreter exit if still running."""
    global _hook_registered
    if not _hook_registered:
        atexit.register(_stop_all)
        _hook_registered = True
    _running.add(resources)


def _stop_all() -> None:
    for resources in list(_running):
        resources.stop()


def child_setup(own_endpoints: Iterable[Any]) -> None:
    if threading.current_thread() is threading.main_thread():  # a Ray actor runs its child in a thread
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    release_all_except(own_endpoints)
    _limit_intra_op_threads()
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_when_parent_dies, args=(parent.sentinel,), daemon=True).start()


def _limit_intra_op_threads() -> None:
    # N workers each running torch's default thread pool would oversubscribe the cores.
    try:
        import torch

        torch.set_num_threads(1)
    except Exception:  # pragma: no cover - torch is a dependency, but never fail a worker over it
        pass


def _exit_when_parent_dies(sentinel: int) -> None:
    wait([sentinel])
    os._exit(0)


def exit_description(process: Any) -> str:
    code = process.exitcode
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def stop_processes(
    processes: Sequence[Any],
    drain: Callable[[float], None] | None = None,
    grace: float = STOP_GRACE,
) -> None:
    """Wait up to ``grace`` seconds for ``processes`` to exit, calling ``drain(timeout)``
    meanwhile so that producers blocked on full channels can move on; then terminate,
    then kill. Returns once every process is reaped."""
    deadline = time.monotonic() + grace
    while True:
        alive = [p for p in processes if p.exitcode is None]
        left = deadline - time.monotonic()
        if not alive or left <= 0:
            break
        if drain is None:
            wait([p.sentinel for p in alive], left)
        else:
            drain(left)
    for escalate, step in (("terminate", _TERMINATE_WAIT), ("kill", _KILL_WAIT)):
        alive = [p for p in processes if p.exitcode is None]
        if not alive:
            break
        for process in alive:
            try:
                getattr(process, escalate)()
            except OSError:
                pass  # it exited since we looked
        wait([p.sentinel for p in alive], step)
    for process in processes:
        process.join(_KILL_WAIT)


def death_error(processes: Sequence[Any]) -> Exception:
    """The error for a child that is gone without being asked: which one, and how it ended.

    The channel can break a moment before the process has exited: give it that moment,
    then reap the ones whose sentinel fired (they are gone or going)."""
    ready = wait([p.sentinel for p in processes], DEATH_GRACE)
    dead = []
    for process in processes:
        process.join(None if process.sentinel in ready else 0)
        if process.exitcode is not None:
            dead.append(f"{process.name} (pid {process.pid}) {exit_description(process)}")
    if not dead:
        return ProcessDiedError("a child process of the reading service closed its channel unexpectedly")
    return ProcessDiedError(
        "; ".join(dead) + ". The reading service cannot continue: look for an out-of-memory kill, a call "
        "to os._exit or a crash in native code in that process (its stderr may say more), then create "
        "a new DataLoader2."
    )
