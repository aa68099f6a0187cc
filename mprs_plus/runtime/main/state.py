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


class State(enum.IntEnum):
    NEW = 0
    PREPARED = 1
    RUNNING = 2
    STOPPING = 3
    STOPPED = 4


class Lifecycle:
    def __init__(self) -> None:
        self._state = State.NEW
        self._lock = threading.Lock()
        self._closed = threading.Event()  # set on entering STOPPING: wakes whoever waits for the stop

    @property
    def state(self) -> State:
        return self._state

    @property
    def closed(self) -> bool:
        """A stop has begun (STOPPING or STOPPED): nothing new may begin."""
        return self._state >= State.STOPPING

    def advance(self, to: State) -> bool:
        """Move on to ``to``; False (and no change) when the state is there or past it
        already. Only forward: a stopped service never runs again."""
        with self._lock:
            if self._state >= to:
                return False
            self._state = to
        if to >= State.STOPPING:
            self._closed.set()
        return True

    def wait_closed(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a stop to begin; whether it has."""
        return self._closed.wait(timeout)
