"""How the main process ends its children: bounded shutdown, the exit hook, and the
error for a child that is gone without being asked. (What a child does first is
``child/lifecycle.py``.)

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
import signal
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Any

from ...errors import ProcessDiedError


STOP_GRACE = 5.0  # seconds children get to exit on their own once asked
_TERMINATE_WAIT = 0.25  # SIGTERM kills at once unless the child is stopped (then SIGKILL does)
_KILL_WAIT = 2.0
DEATH_GRACE = 2.0  # seconds a process whose channel broke may take to be reaped

# Every service of this process not yet collected. Whether one still runs is its own
# state's answer (``main/state.py``), which its ``stop()`` reads: this is no second answer.
_at_exit: weakref.WeakSet[Any] = weakref.WeakSet()
_hook_registered = False


def stop_at_exit(resources: Any) -> None:
    """Stop ``resources`` (anything with an idempotent ``stop()``) at interpreter exit."""
    global _hook_registered
    if not _hook_registered:
        atexit.register(_stop_all)
        _hook_registered = True
    _at_exit.add(resources)


def _stop_all() -> None:
    for resources in list(_at_exit):
        resources.stop()


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


def stop_processes(processes: Sequence[Any], drain: Callable[[float], None] | None = None) -> None:
    """Wait up to ``STOP_GRACE`` seconds (read at each stop) for ``processes`` to exit,
    calling ``drain(timeout)`` meanwhile so that producers blocked on full channels can
    move on; then terminate, then kill. Returns once every process is reaped."""
    deadline = time.monotonic() + STOP_GRACE
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


def death_error(processes: Sequence[Any], out_of_memory: Callable[[], str | None] | None = None) -> Exception:
    """The error for a child that is gone without being asked: which one, and how it ended.

    The channel can break a moment before the process has exited: give it that moment,
    then reap the ones whose sentinel fired (they are gone or going). ``out_of_memory()``:
    whether the kernel's OOM killer killed since it was last asked (``oom.py``), which
    names a SIGKILL as its kill."""
    ready = wait([p.sentinel for p in processes], DEATH_GRACE)
    dead = []
    for process in processes:
        process.join(None if process.sentinel in ready else 0)
        if process.exitcode is not None:
            how = exit_description(process)
            if process.exitcode == -signal.SIGKILL and out_of_memory is not None:
                killer = out_of_memory()
                if killer is not None:
                    how += f" ({killer})"
            dead.append(f"{process.name} (pid {process.pid}) {how}")
    if not dead:
        return ProcessDiedError("a child process of the reading service closed its channel unexpectedly")
    return ProcessDiedError(
        "; ".join(dead) + ". The reading service cannot continue: look for an out-of-memory kill, a call "
        "to os._exit or a crash in native code in that process (its stderr may say more), then create "
        "a new DataLoader2."
    )
