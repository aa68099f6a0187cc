"""How reads in the main process and a stop from any thread keep out of each other's way.

The data receivers may be read by one thread (the loop over the DataLoader2, or several
threads of main-segment DataPipes through the mux) while another thread stops the service
(``DataLoader2.shutdown()``, an exit hook, a finalizer). A receiver is not safe to use from
two threads at once, nor after it is closed. So:

    reader  enter() -- raises ServiceClosedError once closed -- ... -- leave()
    stop    moves the service's state to STOPPING (``state.py``): from then on the gate
            is closed; then close(): wake every reader blocked in a wait (``wake_fd``
            becomes readable for good); wait, bounded, until no reader is inside

Only after ``close()`` returns True does the stop touch the receivers (drain, close).
No lock is held across a blocking wait: a reader waits on its channels *and* on
``wake_fd``, and the stop waits on a condition that readers signal as they leave.

Readers of several threads share the channel mux, where one thread waits for all
(``mux.py``). When another thread comes to want a channel that wait does not cover,
``nudge()`` interrupts it: ``nudge_fd`` becomes readable until ``clear_nudge()``.
"""

from __future__ import annotations

import threading

from ...errors import ServiceClosedError
from ..mux import WakePipe
from .state import Lifecycle

CLOSED_MESSAGE = (
    "this reading service has been shut down (DataLoader2.shutdown() or an earlier error); "
    "create a new DataLoader2 to iterate again"
)


class ReadGate:
    """Closed exactly when the service's state says a stop has begun: the gate keeps no
    flag of its own. A reader checks the state under the gate's lock and the stop takes
    that lock after moving the state on, so a reader the stop does not see inside has
    seen the state and left."""

    def __init__(self, lifecycle: Lifecycle) -> None:
        self.lifecycle = lifecycle
        self._lock = threading.Lock()  # ``with self._lock`` on the per-item path: cheaper than the Condition's
        self._cv = threading.Condition(self._lock)
        self._inside: dict[int, int] = {}  # thread id -> nesting depth of its reads
        self._closing = WakePipe()  # woken once by close(), never cleared
        self.wake_fd = self._closing.fd
        self._nudges = WakePipe()
        self.nudge_fd = self._nudges.fd

    @property
    def closed(self) -> bool:
        return self.lifecycle.closed

    def enter(self) -> None:
        me = threading.get_ident()
        with self._lock:
            if self.closed:
                raise ServiceClosedError(CLOSED_MESSAGE)
            self._inside[me] = self._inside.get(me, 0) + 1

    def leave(self) -> None:
        me = threading.get_ident()
        with self._lock:
            depth = self._inside.pop(me) - 1
            if depth:
                self._inside[me] = depth
            if self.closed:  # only a stop waits on the condition, and only once closed
                self._cv.notify_all()

    def check(self) -> None:
        if self.closed:
            raise ServiceClosedError(CLOSED_MESSAGE)

    def close(self, timeout: float) -> bool:
        """Wake the blocked readers and wait up to ``timeout`` seconds for every reader to
        leave; called by the stop once the state refuses new reads. False when some is
        still inside (then the receivers must be left alone): the calling thread itself (a
        stop from inside a read, e.g. a finalizer run by the garbage collector there), or a
        reader stuck past the bound."""
        if not self.closed:
            raise RuntimeError("internal error: the read gate was closed before the service's stop began")
        me = threading.get_ident()
        with self._cv:
            self._closing.wake()  # never cleared: every later wait returns at once
            if me in self._inside:
                return False
            return self._cv.wait_for(lambda: not self._inside, timeout)

    def nudge(self) -> None:
        """Interrupt the reader that waits for the others (see the module's docstring)."""
        self._nudges.wake()

    def clear_nudge(self) -> None:
        """Called by the interrupted reader, before it looks at its channels again."""
        self._nudges.clear()

    def release(self) -> None:
        """Close the pipes; only once no reader can wait on them any more."""
        self._closing.close()
        self._nudges.close()
