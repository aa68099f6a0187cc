"""The one answer to "is the service stopped?": a state that only moves forward.

    NEW --start()--> PREPARED --last child started--> RUNNING --stop()--> STOPPING --> STOPPED
     |                   |                                                  ^
     +-------------------+------------------- stop() ----------------------+

    NEW        the runtime exists; no channel is open
    PREPARED   every channel is open and wired; some child may not be started yet (under
               fork they start with the first epoch)
    RUNNING    every child is started
    STOPPING   a stop has begun: nothing new starts, no read or send begins, readers leave
    STOPPED    every child is reaped and every channel end of the main process let go

One ``Lifecycle`` per runtime holds it; the supervisor, the read gate, the reader, the
statistics logger and the facade read it, and only the runtime and the supervisor move it
on. A move is atomic (one lock), so two threads that both stop see exactly one of them
begin the stop.
"""

from __future__ import annotations

import enum
import threading
import weakref
from collections.abc import Callable
from typing import Any


class State(enum.IntEnum):
    NEW = 0
    PREPARED = 1
    RUNNING = 2
    STOPPING = 3
    STOPPED = 4


class Lifecycle:
    """``state``, and ``closed``: whether a stop has begun (STOPPING or STOPPED), so that
    nothing new may begin. ``closed`` is the state's answer written beside it, in the same
    move, because reads look at it once per item: a plain attribute costs a fraction of
    comparing enum members there. Both are read-only outside ``advance``."""

    def __init__(self) -> None:
        self.state = State.NEW
        self.closed = False
        self._lock = threading.Lock()
        self._stop_began = threading.Event()  # wakes whoever waits for the stop

    def advance(self, to: State) -> bool:
        """Move on to ``to``; False (and no change) when the state is there or past it
        already. Only forward: a stopped service never runs again."""
        with self._lock:
            if self.state >= to:
                return False
            self.state = to
            if to >= State.STOPPING:
                self.closed = True
        if to >= State.STOPPING:
            self._stop_began.set()
        return True

    def wait_closed(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a stop to begin; whether it has."""
        return self._stop_began.wait(timeout)

    def every(self, seconds: float, owner: Any, action: Callable[[Any], None], name: str) -> None:
        """Call ``action(owner)`` every ``seconds`` on a daemon thread until a stop begins or
        ``owner`` is collected: the thread holds it only weakly, so it never keeps a dropped
        service (or what the service dropped) alive."""
        held = weakref.ref(owner)

        def run() -> None:
            while not self.wait_closed(seconds):
                live = held()
                if live is None:
                    return
                action(live)
                del live

        threading.Thread(target=run, name=name, daemon=True).start()
