"""Starts the children, sends them control messages, and stops them: a stop that cannot block.

    prepare record how to start a ChildLink's process; ``hold`` keeps the channel ends
            the children will own until every child is started
    launch  start that process, its control sender watching its sentinel; once the last
            one is started, let go of the children's ends and have every blocked read
            watch every child. ``send_first`` queues a child's first message in its
            control channel *before* launching it, so that it begins work on it at once
            (fork: worker 0 produces while the main process still forks worker 1)
    send    a control message: a non-blocking try, then a bounded wait in short slices
            that watches the child's sentinel and the stop; a child that takes no message
            for ``CONTROL_WAIT`` seconds is stuck (SIGSTOP, a C call holding its GIL):
            the service stops and the caller gets a TimeoutError saying so
    stop    0. the state moves to STOPPING (``state.py``): no read, send or start begins;
               what asked to see the service one last time (``at_stop``: the statistics
               as they stand) does, while the children still run
            1. close every control sender: that *is* the children's STOP (their listener
               sees the end of the stream), and closing never waits
            2. close the read gate: readers in other threads wake up and leave
            3. wait ``STOP_GRACE`` for the children, meanwhile skipping (never unpickling)
               whatever they still write, so that none stays blocked on a full channel;
               then SIGTERM, then SIGKILL
            4. let go of the ends held for children that never started
            5. close the main process's ends of the data channels, and the reaped
               processes' handles (each ``Process`` keeps two pipe descriptors): a
               shut-down service that is still referenced holds no descriptor. Where no
               reader is inside, the ends close as soon as every child closed its own
               (step 3), and what the main process read from them and never handed out
               goes with them (``when_released``)
            6. close the placement (``backends``): nothing locally; on Ray, every actor
               (replaced ones included) killed and waited for, each on its own (bounded)
            7. the state moves to STOPPED

Every step runs whatever the previous ones raised (``_Steps``), so escalation and release
always happen. ``stop()`` is idempotent and thread-safe: a second caller waits for the
first one's stop (bounded) and returns.

The supervisor is what the finalizer and the exit hook hold; it references no facade, so
dropping the last reference to the facade runs the finalizer at once.

Locks: ``_stop_lock`` (re-entrant) serializes stops and launches, so a stop never lets go of
the channel ends a fork is about to inherit; ``_control_lock`` is held by a sender only for
one short slice of a send, so a stop closing the senders waits at most one slice.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from ...errors import ServiceClosedError
from ...transport import ChannelError, Endpoint, wait_readable
from ...backends import LocalBackend, Placement
from .gate import CLOSED_MESSAGE, ReadGate
from .lifecycle import DEATH_GRACE, stop_processes
from .state import Lifecycle, State
from .topology import ChildLink, Topology

CONTROL_ITEMS = 4  # control messages are small and rare; a few in flight is plenty
CONTROL_BYTES = 1 << 20
# A message this small fits whole in any empty control channel, a pipe's smallest kernel
# buffer (one page) included, so queueing it before its reader exists never waits.
QUEUE_FIRST_BYTES = 2048
CONTROL_WAIT = 30.0  # seconds a live child may leave its control channel full
_SLICE = 0.1  # seconds of one blocking send, between two looks at the stop and the sentinel
_GATE_WAIT = 2.0  # seconds a stop waits for readers of other threads to leave


class ExitedProcess(NamedTuple):
    """What the link of a reaped child keeps once its ``Process`` is closed: what errors
    and statistics still read of it."""

    name: str
    pid: int
    exitcode: int


class Supervisor:
    def __init__(self, topology: Topology, ctx: Any, placement: Placement | None = None) -> None:
        self.topology = topology
        self.lifecycle = Lifecycle()  # the service's one state: every "is it stopped?" reads it
        self.gate = ReadGate(self.lifecycle)
        # Where children run (``backends``): processes of this host unless told otherwise.
        self.placement = placement if placement is not None else LocalBackend().open(ctx)
        self._ctx = ctx
        self._owner_pid = os.getpid()
        self._stop_lock = threading.RLock()
        self._control_lock = threading.RLock()
        self._drained: set[int] = set()  # ids of data receivers found ended while stopping
        # Children not started yet, in start order: the process body and its argument.
        self._pending: dict[ChildLink, tuple[Callable[[Any], None], Any]] = {}
        # Channel ends that belong to the children: held until every child is started
        # (a fork inherits them), then released here.
        self._held: list[Endpoint] = []
        self._last_looks: list[Callable[[], None]] = []  # run first in the stop (``at_stop``)
        self._after_ends: list[Callable[[], None]] = []  # run once the children ended (``once_ended``)
        self._when_quiet: list[Callable[[], None]] = []  # run once they stopped sending (``once_quiet``)
        self._on_release: list[Callable[[], None]] = []  # run as the data receivers close (``when_released``)
        self._steps = _Steps()  # the steps of the stop under way

    # -- start ---------------------------------------------------------------------------

    def hold(self, *ends: Endpoint) -> None:
        """Keep channel ends that belong to children until every child has started (a fork
        inherits them), then let go of them here; a stop lets go of them in any case."""
        self._held.extend(ends)

    def prepare(self, link: ChildLink, target: Callable[[Any], None], setup: Any) -> None:
        """Record how to start ``link``'s process: ``target(setup)``."""
        self._pending[link] = (target, setup)

    @property
    def pending(self) -> bool:
        """Some child is not started yet."""
        return bool(self._pending)

    def launch(self, link: ChildLink) -> None:
        """Start ``link``'s process unless it is started already."""
        with self._stop_lock:
            if link not in self._pending:
                return
            if self.lifecycle.closed:
                raise ServiceClosedError(CLOSED_MESSAGE)
            target, setup = self._pending.pop(link)
            process = self.placement.start(link.name, target, setup)
            link.attach(process)
            link.control.watch(process.sentinel)
            if not self._pending:
                self._release_held()
                self._watch_children()
                self.lifecycle.advance(State.RUNNING)

    def relaunch(
        self, link: ChildLink, control: Endpoint, data: tuple[Any, ...], target: Callable[[Any], None], setup: Any, ends: list[Endpoint]
    ) -> None:
        """Replace ``link``'s dead process by a new one running ``target(setup)`` over new
        channels (``control`` and ``data``, the main process's ends; ``ends``, the child's,
        let go of here once it started). The dead one's channels are closed: lent buffers
        the loop still holds keep their memory (``transport/_lend.py``)."""
        with self._stop_lock:
            if self.lifecycle.closed:
                for end in [control, *data, *ends]:
                    with contextlib.suppress(Exception):
                        end.close()
                raise ServiceClosedError(CLOSED_MESSAGE)
            old = link.process
            old.join(DEATH_GRACE)
            with self._control_lock:
                with contextlib.suppress(Exception):
                    link.control.close()
            for receiver in link.data:
                with contextlib.suppress(Exception):
                    receiver.close()
            link.rewire(control, data)
            with contextlib.suppress(ValueError):
                old.close()
            self._held.extend(ends)
            try:
                process = self.placement.start(link.name, target, setup)
            finally:
                self._release_held()
            link.attach(process)
            link.control.watch(process.sentinel)
            self._watch_children()

    def launch_all(self) -> None:
        for link in list(self._pending):
            self.launch(link)

    def _watch_children(self) -> None:
        """Once all are started: a blocked read of any data channel also watches every child."""
        sentinels = [link.process.sentinel for link in self.topology.started()]
        for _, receiver in self.topology.data_receivers():
            receiver.watch(*sentinels)

    def _drop_unstarted(self) -> None:
        """Stopping: children not started yet never will be; nobody else lets go of their ends."""
        self._pending.clear()
        self._release_held()

    def _release_held(self) -> None:
        held, self._held = self._held, []
        for end in held:
            with contextlib.suppress(Exception):
                end.release()  # each belongs to a child now (or to nobody, after a failure)

    # -- control -------------------------------------------------------------------------

    def send_first(self, link: ChildLink, message: Any) -> None:
        """Send ``message``; to a child not started yet, queue it in the child's (empty)
        control channel first and then start the child, which finds it there at once.

        Only a small message is queued so (a Reset with a seed generator is a few hundred
        bytes): a larger one could wait for a reader that does not exist yet."""
        with self._stop_lock:
            if link in self._pending and len(message.payload) <= QUEUE_FIRST_BYTES:
                if self.lifecycle.closed:
                    raise ServiceClosedError(CLOSED_MESSAGE)
                try:
                    link.control.send(message, timeout=0)
                except TimeoutError:
                    pass  # no room after all (cannot happen to an empty channel): start it, then send
                else:
                    self.launch(link)
                    return
        self.send(link, message)

    def send(self, link: ChildLink, message: Any) -> None:
        """Send ``message`` on ``link``'s control channel without ever blocking for long;
        a child not started yet is started first."""
        if link in self._pending:  # only the thread that begins epochs starts children
            self.launch(link)
        deadline = time.monotonic() + CONTROL_WAIT
        timeout = 0.0  # first a non-blocking try: the usual case
        while True:
            with self._control_lock:
                if self.lifecycle.closed:
                    raise ServiceClosedError(CLOSED_MESSAGE)
                try:
                    link.control.send(message, timeout=timeout)
                    return
                except TimeoutError:
                    pass
                except ChannelError as exc:
                    raise self.death_error() from exc
            if not link.alive:
                raise self.death_error()
            if time.monotonic() >= deadline:
                pid = link.process.pid
                self.stop()
                raise TimeoutError(
                    f"{link.name} (pid {pid}) has not read its control channel for {CONTROL_WAIT:.0f} s although "
                    "it is alive: it is stopped (SIGSTOP, a debugger) or stuck in native code that holds its GIL. "
                    "The reading service was shut down; create a new DataLoader2."
                )
            timeout = _SLICE

    def death_error(self) -> Exception:
        if self.lifecycle.closed:
            return ServiceClosedError(CLOSED_MESSAGE)
        return self.placement.death_error([link.process for link in self.topology.started()])

    # -- stop ----------------------------------------------------------------------------

    def at_stop(self, last_look: Callable[[], None]) -> None:
        """Run ``last_look()`` first in the stop, while the children still run. It must not
        reference the facade (the finalizer holds this supervisor)."""
        self._last_looks.append(last_look)

    def once_quiet(self, step: Callable[[], None]) -> None:
        """Run ``step()`` in the stop once every child closed its data channels to this
        process, or ended (or could not be ended), whichever comes first: a child closes
        them as its last act, and the kernel then takes milliseconds to end its process,
        which the step overlaps. As with ``at_stop``, it must not reference the facade."""
        self._when_quiet.append(step)

    def when_released(self, step: Callable[[], None]) -> None:
        """Run ``step()`` in the stop where it closes the main process's ends of the data
        channels, no reader being inside (none is then left to hand out what was read):
        the step drops what the main process read and holds. An item lent from a
        channel's shared memory keeps it mapped here; dropped before the children end,
        the last reference to those pages is a child's, which frees them as it exits,
        each on its own core, rather than this process after them (1 MiB tensors in
        batches of 8: 5 ms of a 20 ms stop). As with ``at_stop``, it must not reference
        the facade."""
        self._on_release.append(step)

    def once_ended(self, step: Callable[[], None]) -> None:
        """Run ``step()`` in the stop once the children ended (or could not be ended). As
        with ``at_stop``, it must not reference the facade."""
        self._after_ends.append(step)

    def stop(self) -> None:
        """Stop every child and close every endpoint. Idempotent, thread-safe, bounded in
        time; a no-op in a forked child."""
        if os.getpid() != self._owner_pid:
            return
        with self._stop_lock:
            if not self.lifecycle.advance(State.STOPPING):
                return  # stopped, or stopping in this thread (a finalizer run inside the stop)
            steps = self._steps = _Steps()
            for last_look in self._last_looks:
                steps.run(last_look)
            steps.run(self._close_controls)
            exclusive = steps.run(self._close_gate, default=False)
            steps.run(self._end_children, exclusive)
            self._run_quiet_steps()  # where they did not run while the children ended
            for step in self._after_ends:
                steps.run(step)
            steps.run(self._drop_unstarted)
            steps.run(self._release_main_ends, exclusive)
            steps.run(self.placement.close)
            steps.run(self.lifecycle.advance, State.STOPPED)
            steps.raise_first()

    def _close_controls(self) -> None:
        with self._control_lock:
            for link in self.topology.started():
                with contextlib.suppress(Exception):
                    link.control.close()
            for link in self.topology.children():  # never started: drop our end all the same
                if link.control is not None and link.process is None:
                    with contextlib.suppress(Exception):
                        link.control.close()

    def _close_gate(self) -> bool:
        """Whether the stop now owns the data receivers: no reader is inside."""
        return self.gate.close(_GATE_WAIT)

    def _end_children(self, exclusive: bool) -> None:
        processes = [link.process for link in self.topology.started()]
        stop_processes(processes, drain=self._drain if exclusive else None)

    def _release_main_ends(self, exclusive: bool) -> None:
        if not exclusive:
            return  # a reader is still inside: closing under it would break it; the process exit frees them
        self._close_receivers()
        self.gate.release()
        for link in self.topology.started():
            process = link.process
            if isinstance(process, ExitedProcess) or process.exitcode is None:
                continue  # not reaped (the stop could not kill it): keep its handle
            link.retire(ExitedProcess(process.name, process.pid, process.exitcode))
            with contextlib.suppress(ValueError):
                process.close()

    def _close_receivers(self) -> None:
        """Only where no reader is inside (the stop owns the receivers): what was read from
        them goes first (``when_released``), then every end closes."""
        release, self._on_release = self._on_release, []
        for step in release:
            self._steps.run(step)
        for _, receiver in self.topology.data_receivers():
            with contextlib.suppress(Exception):
                receiver.close()

    def _run_quiet_steps(self) -> None:
        """The ``once_quiet`` steps, once, as steps of the stop under way."""
        quiet, self._when_quiet = self._when_quiet, []
        for step in quiet:
            self._steps.run(step)

    def _drain(self, timeout: float) -> None:
        """Skip what the workers still write while they stop, so that none stays blocked on
        a full channel. Skipping never unpickles: an item that failed to unpickle (maybe
        the very reason for this stop) cannot fail the stop."""
        receivers = [r for _, r in self.topology.data_receivers() if id(r) not in self._drained]
        if not receivers:  # every child closed its channels: while the kernel ends them,
            if self._when_quiet:
                self._run_quiet_steps()
            # our ends go too: the children's exits, which the stop waits for anyway, then
            # free the channels' pages, each on its own core, not this process after them.
            self._close_receivers()
        alive = {link.process.sentinel: link.process for link in self.topology.started() if link.alive}
        if not alive:
            return  # every child exited since the caller looked: nothing left to wait for
        for ready in wait_readable(receivers, timeout, also=list(alive)):
            if isinstance(ready, int):
                # Its sentinel fired: the process is gone or in its last moments; reap it
                # rather than wake up again and again until the kernel lets us.
                alive[ready].join(DEATH_GRACE)
                continue
            try:
                while ready.skip():
                    pass
            except ChannelError:
                self._drained.add(id(ready))


_T = TypeVar("_T")


class _Steps:
    """Steps run in reading order, each whatever the earlier ones raised; the first error
    is raised once all have run."""

    def __init__(self) -> None:
        self._error: BaseException | None = None

    def run(self, step: Callable[..., _T], *args: Any, default: _T | None = None) -> _T | None:
        try:
            return step(*args)
        except BaseException as exc:
            if self._error is None:
                self._error = exc
            return default

    def raise_first(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error
