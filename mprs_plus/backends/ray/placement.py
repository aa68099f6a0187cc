"""Children as Ray actors: start them where the backend's options say, watch them, stop them.

    RayPlacement.start(name, target, setup)
        actor = a warm one of these settings (``warm.py``), alive, or a new
                SegmentHost.options(num_cpus, resources, scheduling_strategy, runtime_env)
        its control receiver learns its host (deliveries go to it); the ends of data
        channels placed first listen in it: actor.listen(specs) -> addresses, which their
        peers connect to (in later actors, or here)                 (``channel.py``);
        a peer on the same node (by node id) hands a sending end a shared-memory
        channel instead, over a Unix-domain socket           (``transport/handover.py``)
        actor.run(target, setup)   the child's life, as a local process's
        -> ActorProcess: the ``multiprocessing.Process`` members the supervisor uses

An ``ActorProcess``'s sentinel is a pipe that a watcher thread closes when the actor's
``run`` call ends, however it ends: returned (the service stopped it), failed (an exception
escaped, or its setup could not be unpickled on the node), or the actor died (killed, its
node lost). Ray reports an actor on a lost node dead after its node-failure detection
(health checks of the control store); the watcher looks every ``_LOOK`` seconds, so a dead
actor is an error in the training process within that detection plus a second or two.
An actor that is not running ``START_TIMEOUT`` seconds after it was asked for (no node has
the resources it needs, its runtime_env fails) is an error too.

Every actor is owned by the training process: if it dies, even by SIGKILL, Ray ends them
(owner death); ``close()`` gives an actor whose child ended as asked back to the pool of
warm actors (``RayBackend(warm_for=...)``), kills the others and waits, bounded, until Ray
reports them gone, then closes every data connection of this process (it never listens:
its ends connect).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from ...errors import ProcessDiedError
from ...transport.stream import StreamReceiver, StreamSender, new_secret
from . import connection
from .actor import remote_class
from .calls import get_without_cycle, in_helper
from .connection import first_line
from .warm import pool, pool_key
from .channel import ActorAddress, RayReceiver, open_ray_channel, open_stream_channel

START_TIMEOUT = 120.0  # seconds an actor may take to start (a runtime_env may install packages)
_LOOK = 0.5  # seconds between two looks of a watcher at its actor
# Seconds a death error waits for a watcher to say why an actor's stream broke. 2 s was too
# short beside two test suites on two cores (a failed import read as "stopped answering").
_DEATH_REASON_WAIT = 10.0
_CLOSE_WAIT = 10.0  # seconds close() waits for Ray to report killed actors gone
_KILL_CALL_WAIT = 2.0  # seconds one kill request may take before the stop moves on
_DIED = -9  # an actor's exit code once Ray reported it dead (read as SIGKILL: Ray says no more)
_STATS_WAIT = 1.0  # seconds stats() waits for the actors' figures
# Small items per message from a worker actor (local workers: 64). Tiny items, two actors:
# the training process's CPU per item 1.7 -> 1.0 µs, the steady rate 1.6x (docs/ray.md).
BATCH_ITEMS = 256
RAY_CALL_THREAD = "mprs_plus ray call"  # the name of the helper threads of ``_bounded``


class ActorProcess:
    """A child running in a Ray actor, seen as a process."""

    def __init__(self, name: str, actor: Any, run: Any, where: Any) -> None:
        self.name = name
        self.actor = actor
        self._killed = False  # asked to be killed: never given back
        self.exitcode: int | None = None
        self.reason = ""  # why it ended, in words, when not asked to
        self.cannot_load = False  # it ended because the segment's code is not on its node
        self.refused = 0  # connections its listeners refused, as of the last statistics it sent
        self._run = run
        self._where_ref = where
        self._where: dict[str, Any] | None = None
        self._done = threading.Event()
        self._closing = threading.Event()
        self.sentinel, self._wake = os.pipe()
        self._watcher = threading.Thread(target=self._watch, name=f"{name} watcher", daemon=True)
        self._watcher.start()

    @property
    def pid(self) -> int | None:
        where = self.where()
        return None if where is None else where["pid"]

    @property
    def node(self) -> str:
        where = self.where()
        if where is None:
            return "an unknown node"
        return f"{where['ip']} (node id {where['node_id'][:12]})"

    def where(self, timeout: float = 0.0) -> dict[str, Any] | None:
        """Where the actor runs; None while that is not known yet."""
        if self._where is None:
            with contextlib.suppress(Exception):
                self._where = get_without_cycle(self._where_ref, timeout=timeout)
        return self._where

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def terminate(self) -> None:
        """Ask Ray to kill the actor; waits at most ``_KILL_CALL_WAIT`` seconds for Ray to
        take the request (see ``_bounded``)."""
        self._killed = True
        _bounded(lambda: _kill(self.actor), _KILL_CALL_WAIT)

    @property
    def started(self) -> Any:
        """The answer of a call that came once the actor had started (its ``where``)."""
        return self._where_ref

    def reusable(self) -> bool:
        """Its child ended as asked (``run`` returned) and nobody asked for a kill: the
        actor may host a next child."""
        return self._done.is_set() and self.exitcode == 0 and not self._killed

    kill = terminate

    def _watch(self) -> None:
        started = time.monotonic()
        try:
            while not self._closing.is_set():
                ready, _ = ray.wait([self._run], timeout=_LOOK)
                if ready:
                    self._ended()
                    return
                if self.where() is None and time.monotonic() - started > START_TIMEOUT:
                    self.reason = (
                        f"did not start within {START_TIMEOUT:.0f} s: no node of the cluster offers the resources "
                        "it asks for (num_cpus_per_worker, resources, scheduling_strategy), or its runtime_env "
                        "failed to set up (see `ray status` and the cluster's logs)"
                    )
                    self.exitcode = 1
                    self.terminate()
                    return
        except Exception as exc:  # Ray itself failed (its driver connection is gone)
            self.reason = f"could not be watched any more ({type(exc).__name__}: {exc})"
            self.exitcode = 1
        finally:
            self._done.set()
            with contextlib.suppress(OSError):
                os.close(self._wake)  # the sentinel becomes readable (end of file)

    def _ended(self) -> None:
        self.where(timeout=1.0)
        try:
            get_without_cycle(self._run, timeout=0)
        except ray.exceptions.RayActorError as exc:
            self.exitcode = _DIED
            self.reason = f"its Ray actor died: {first_line(exc)}"
        except ray.exceptions.RayTaskError as exc:
            self.exitcode = 1
            cause = exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else None
            text = str(exc)
            # Ray wraps an error of unpickling the setup in a system error that keeps only its text.
            if isinstance(cause, (ImportError, AttributeError)) or "ModuleNotFoundError" in text or (
                "No module named" in text or "Can't get attribute" in text
            ):
                self.cannot_load = True
                self.reason = (
                    "could not load the pipeline's code on its node "
                    f"({first_line(cause or exc)}): ship it with RayBackend(runtime_env={{'working_dir': ...}}) "
                    "or runtime_env={'py_modules': [...]}, or install it on every node"
                )
            else:
                self.reason = f"failed: {first_line(cause or exc)}"
        except Exception as exc:
            self.exitcode = 1
            self.reason = f"ended with {type(exc).__name__}: {first_line(exc)}"
        else:
            self.exitcode = 0

    def stop_watching(self) -> None:
        """The watcher ends at its next look (``close`` waits for it)."""
        self._closing.set()

    def close(self) -> None:
        """Idempotent: a replaced actor's process is closed when it is replaced, and again
        by the placement's close (its descriptor number may belong to another file by then)."""
        self._closing.set()
        self._watcher.join(2 * _LOOK)
        sentinel, self.sentinel = self.sentinel, -1
        if sentinel >= 0:
            with contextlib.suppress(OSError):
                os.close(sentinel)


class RayPlacement:
    start_at_once = True  # no fork to save: every actor starts while the first epoch is sent
    on_this_host = False  # actors on any node of the cluster
    # Seconds a child whose stream broke may take to be known dead: Ray reports it, and
    # the watcher sees that on its next look (the local backend's is ``DEATH_GRACE``).
    death_grace = _DEATH_REASON_WAIT

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._started_ray = connection.attach(backend)
        self.processes: list[ActorProcess] = []
        # Attached to a Ray this process initialized: the runtime_env goes with each actor.
        self._actor_env = backend.runtime_env if not self._started_ray else None
        # Warm actors (``warm.py``): those of the services before this one, of these settings.
        self._warm_for = float(backend.warm_for)
        self.key = pool_key(backend, self._actor_env is not None)
        # The data channels: one secret for all of this service's, both ends of each (by
        # key), and the keys whose listening end is placed already.
        self._secret = new_secret()
        self._streams: dict[str, tuple[StreamSender, StreamReceiver]] = {}
        self._listening: set[str] = set()

    def open_channel(
        self, *, capacity_items: int, capacity_bytes: int, control: bool = False, refill_at_half: bool = False
    ) -> tuple[Any, Any]:
        """A control channel over Ray calls, or a data channel over a stream (whose sender
        waits on its credits as they come: ``refill_at_half`` changes nothing)."""
        del refill_at_half
        if control:
            return open_ray_channel(capacity_items=capacity_items, capacity_bytes=capacity_bytes, control=True)
        ends = open_stream_channel(self._secret, capacity_items=capacity_items, capacity_bytes=capacity_bytes)
        self._streams[ends[0].key] = ends
        # Read here, the receiving end lands a stream from another node (a copy sent to an
        # actor does not: ``land`` is not pickled).
        ends[1].land = bool(self._backend.landing)
        return ends

    def actor_options(self) -> dict[str, Any]:
        """What each actor is made with (``ray.remote``'s options)."""
        backend = self._backend
        options: dict[str, Any] = {
            "num_cpus": backend.num_cpus_per_worker,
            # Threads: the child's own, control deliveries, listen, stats.
            "max_concurrency": 4,
            "name": None,
        }
        if backend.resources:
            options["resources"] = dict(backend.resources)
        if backend.scheduling_strategy is not None:
            options["scheduling_strategy"] = backend.scheduling_strategy
        if self._actor_env is not None:
            options["runtime_env"] = dict(self._actor_env)
        return {k: v for k, v in options.items() if v is not None}

    def new_actor(self, name: str) -> Any:
        """A new actor (Ray starts its process meanwhile)."""
        try:
            return remote_class().options(**self.actor_options()).remote()
        except ValueError as exc:
            raise ValueError(
                f"{name} cannot be started as a Ray actor with these options: {first_line(exc)}. Ray was "
                "initialized before the service started, and Ray uploads local directories (runtime_env "
                "working_dir, py_modules) only from ray.init: pass that runtime_env to ray.init(...) yourself, "
                "or let RayBackend connect (do not call ray.init first)."
            ) from None

    def start(self, name: str, target: Callable[[Any], None], setup: Any) -> ActorProcess:
        receivers, streams = _endpoints(setup)
        taken = pool.take(self.key) if self._warm_for > 0 else None
        if taken is not None:
            actor, where = taken
        else:
            if pool.has_other_than(self.key):
                pool.end_others(self.key)  # idle actors of other settings hold resources this one may need
            actor = self.new_actor(name)
            where = None
        for receiver in receivers:
            receiver._spec.host = actor  # its sender delivers to this actor
        self._place_streams(actor, streams)
        if where is None:
            where = actor.where.remote()
        # The statistics table is shared memory of this host: the actor's lanes write one of
        # their own (``SegmentHost.run``), which ``refresh_stats`` copies here.
        rows: tuple[int, ...] = ()
        if getattr(setup, "stats", ()):
            rows = tuple(writer._row for writer in setup.stats)
            setup = setup._replace(stats=())
        # The liveness slots are shared memory of this host too, read on every slice of a
        # starved read: an actor does not report its sleeps (a stuck read is then found by
        # the service's timeout, not at once).
        if getattr(setup, "liveness", ()):
            setup = setup._replace(liveness=())
        # A message over a stream (and through its landing process) costs both ends more
        # than one through a local ring: a worker's small items travel more per message.
        if hasattr(setup, "batch_items"):
            setup = setup._replace(batch_items=BATCH_ITEMS)
        # Ray's cloudpickle carries the segments: the training script's own classes and
        # functions by value (as Ray's tasks and Ray Data take them), modules by reference.
        from ...runtime.segments import for_cloudpickle

        setup = for_cloudpickle(setup)
        try:
            run = actor.run.remote(target, setup, rows)
        except Exception as exc:
            with contextlib.suppress(Exception):
                ray.kill(actor)
            raise TypeError(
                f"{name} cannot be started as a Ray actor: its segment cannot be serialized "
                f"({type(exc).__name__}: {first_line(exc)}). Use module-level functions, and open files and "
                "connections inside __iter__ rather than in __init__."
            ) from None
        process = ActorProcess(name, actor, run, where)
        self.processes.append(process)
        return process

    def _place_streams(self, actor: Any, ends: Sequence[StreamSender | StreamReceiver]) -> None:
        """The first end of a data channel to be placed listens, in its actor on that
        actor's node; its peer (in a later actor, or here) connects to the address the
        actor's ``listen`` call answers."""
        listening = [end for end in ends if end.key not in self._listening]
        if not listening:
            return
        senders = [isinstance(end, StreamSender) for end in listening]  # a peer on their node gets shm
        answer = actor.listen.remote([end.spec for end in listening], senders, self._backend.listen_interface)
        for index, end in enumerate(listening):
            self._listening.add(end.key)
            for peer in self._streams[end.key]:
                if peer is not end:
                    peer.connect_to(ActorAddress(answer, index))

    def node_of(self, process: Any) -> str | None:
        return process.node if isinstance(process, ActorProcess) else None

    def refused_connections(self, process: Any) -> int:
        return process.refused if isinstance(process, ActorProcess) else 0

    def refresh_stats(self, table: Any, links: Sequence[Any]) -> None:
        """Copy the statistics rows of the actors of ``links`` into ``table`` (this host's),
        their times moved to this process's clock, and the count of connections each
        actor's listeners refused. An actor that does not answer within ``_STATS_WAIT``
        keeps its last figures."""
        from ...runtime.stats import FIELDS

        asked = {}
        for link in links:
            process = link.process
            if isinstance(process, ActorProcess) and process.exitcode is None and link.stats_rows:
                asked[process.actor.stats.remote(link.stats_rows)] = link
        if not asked:
            return
        ready, _ = ray.wait(list(asked), num_returns=len(asked), timeout=_STATS_WAIT)
        width = len(FIELDS)
        started = FIELDS.index("started")
        for ref in ready:
            link = asked[ref]
            try:
                then, rows, refused = get_without_cycle(ref, timeout=0)
            except Exception:
                continue  # gone meanwhile: its death is reported by the reads
            link.process.refused = refused
            shift = time.monotonic() - then
            for row, values in zip(link.stats_rows, rows):
                for i, name in enumerate(FIELDS):
                    value = values[name]
                    table._table[row * width + i] = value + shift if i == started and value else value

    def death_error(self, processes: Sequence[Any]) -> Exception:
        # A stream breaks a moment before the watcher (a look every _LOOK s, each a Ray call
        # that a loaded node answers late) sees why: wait, bounded, for its reason.
        # A landing process that was killed (not one whose stream broke) is the reason itself.
        deadline = time.monotonic() + _DEATH_REASON_WAIT
        while (
            time.monotonic() < deadline
            and not any(p.exitcode is not None for p in processes)
            and not self._failed_here()
        ):
            time.sleep(0.05)
        # A channel that failed here comes first: an actor whose stream a killed landing
        # process closed ends too, but only because of it.
        failed = self._problems_here(only_failed=True)
        dead = [
            f"{p.name} (Ray actor on {p.node}, pid {p.pid}) {p.reason or 'ended without being asked'}"
            for p in processes
            if p.exitcode is not None
        ]
        if not failed and not dead:
            failed = self._problems_here()  # a stream that broke, its actor still running
        if failed:
            return ProcessDiedError(
                "a data channel from a Ray actor of the reading service failed in the training process: "
                + "; ".join(failed)
                + ". The reading service cannot continue: create a new DataLoader2."
            )
        if not dead:
            return ProcessDiedError("a Ray actor of the reading service stopped answering its channel unexpectedly")
        if all(p.cannot_load for p in processes if p.exitcode is not None):
            error = ProcessDiedError(
                "; ".join(dead) + ". The reading service cannot continue: create a new DataLoader2 once the code "
                "reaches the nodes."
            )
            error.explained = True
            return error
        return ProcessDiedError(
            "; ".join(dead) + ". The reading service cannot continue. Look at `ray status` and the node's logs "
            "(an out-of-memory kill, a lost node, a crash in native code), then create a new DataLoader2."
        )

    def _problems_here(self, only_failed: bool = False) -> list[str]:
        receivers = [ends[1] for ends in self._streams.values()]
        problems = (r.problem_here() for r in receivers if not only_failed or r.failed_here())
        return [p for p in problems if p]

    def _failed_here(self) -> bool:
        """Some data channel of this service failed in this process (a landing process
        that could not start or was killed, a listen the actor could not make): the reason
        is here, no actor's watcher will tell more."""
        return any(receiver.failed_here() for _, receiver in self._streams.values())

    def close(self) -> None:
        """Kill every actor still there (replacements of dead ones included) and wait
        (bounded) until Ray reports it gone; stop the local Ray this placement started,
        never a cluster it attached to.

        Every actor is killed at once, each in a helper thread of its own that then waits
        until Ray has it gone, all joined with one deadline: a kill waits on the control
        store in native code, which no timeout or signal of this process can end, and the
        kill of an actor Ray already knows dead may wait there longest. No kill waits for
        another, so a live actor is killed whatever the dead ones' kills do, and a stop
        never waits on a cluster that stopped answering. Past the deadline the actors are
        left to Ray's owner-death rule (they end when this process does)."""
        processes, self.processes = self.processes, []
        deadline = time.monotonic() + _CLOSE_WAIT
        for process in processes:
            process.stop_watching()  # every watcher ends within one look, all together
        if self._warm_for > 0 and pool.accepts():
            # An actor whose child ended as asked waits for the next service (``warm.py``);
            # the others (killed, failed, stuck) are killed below.
            warm = [p for p in processes if p.reusable()]
            for process in warm:
                process.close()
                pool.give(self.key, process.actor, process.started, self._warm_for)
            processes = [p for p in processes if p not in warm]
        helpers = [_in_helper(functools.partial(_kill_and_wait, process, deadline)) for process in processes]
        for helper in helpers:
            helper.join(max(0.0, deadline - time.monotonic()))
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
            process.close()
        streams, self._streams = self._streams, {}
        for _, receiver in streams.values():
            with contextlib.suppress(Exception):
                receiver.close()  # asks its landing process to end: all at once, each release waits
        for ends in streams.values():
            for end in ends:
                with contextlib.suppress(Exception):
                    end.release()  # the connections of this process: none stays open
        if self._started_ray:
            self._started_ray = False
            connection.detach()  # the last user disconnects: a Ray started here stops with it


def _kill(actor: Any) -> None:
    with contextlib.suppress(Exception):
        ray.kill(actor, no_restart=True)


def _kill_and_wait(process: ActorProcess, deadline: float) -> None:
    """In a helper thread of ``close``, one per actor: kill it, then wait until a call to
    it fails (Ray has it dead: it is gone for good), at most until ``deadline``."""
    _kill(process.actor)
    probe = process.actor.where.remote()
    ray.wait([probe], timeout=max(0.0, deadline - time.monotonic()))


def _bounded(call: Callable[[], Any], timeout: float) -> None:
    """Run ``call`` in a daemon thread and wait for it at most ``timeout`` seconds; its
    exceptions are dropped (a stop reports nothing of Ray's)."""
    _in_helper(call).join(timeout)


def _in_helper(call: Callable[[], Any]) -> threading.Thread:
    return in_helper(call, RAY_CALL_THREAD)


def _endpoints(setup: Any) -> tuple[list[RayReceiver], list[StreamSender | StreamReceiver]]:
    """The endpoints in a child's setup (top-level fields and tuples of them): control
    receivers, and ends of data streams."""
    receivers: list[RayReceiver] = []
    streams: list[StreamSender | StreamReceiver] = []

    def visit(value: Any) -> None:
        if isinstance(value, RayReceiver):
            receivers.append(value)
        elif isinstance(value, (StreamSender, StreamReceiver)):
            streams.append(value)
        elif isinstance(value, (tuple, list)):
            for item in value:
                visit(item)

    for value in setup:
        visit(value)
    return receivers, streams
