"""Warm actors: the actors a service no longer needs wait in this process for the next one.

    service's close  an actor whose child ended as asked (its ``run`` returned) --> give(key)
                     any other (killed, failed, stuck at the stop) is killed as before
    service's start  take(key): the latest actor given back whose ``where`` answers within
                     ``TAKE_WAIT`` s (one still starting, pre-started, is waited for first,
                     at most ``STARTING_WAIT`` s); a dead one is killed and the next tried;
                     none: a new actor, and idle actors of other settings are ended (they
                     hold the cluster's resources that the new one may need)
    reaper thread    an actor idle for ``RayBackend.warm_for`` seconds is killed
    close(key)       ``RayBackend.close()``: its idle actors killed, and waited for (bounded)
    exit hook        every idle actor killed (bounded); Ray's owner death ends them anyway

The key is what a fresh actor would be made with: the Ray job (a new ``ray.init`` is a new
job: the old job's actors are gone), the runtime environment, ``num_cpus_per_worker``,
``resources`` and ``scheduling_strategy``. A taken actor runs a new child from scratch:
a new setup (the dataset as the loader holds it now, this service's seeds, channels and
secret), ``worker_init_fn`` again; what the last child left in it is let go of when that
child ended (``SegmentHost.run``). What stays is the process: its imports (torch), and
module-level state a pipeline changed.

While it keeps actors on a connection that the backend made (``connection.py``), the pool
is one of its users: the connection, and the actors, last until it is empty.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import threading
import time
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import ray

from . import connection
from .calls import get_without_cycle, in_helper

TAKE_WAIT = 30.0  # seconds an idle actor may take to answer when taken (a dead one fails at once;
# a loaded node answers late, and a lost one fails once Ray has found it lost)
STARTING_WAIT = 120.0  # seconds a pre-started actor may take to start (as placement.START_TIMEOUT)
_CLOSE_WAIT = 10.0  # seconds close() waits for Ray to report the killed actors gone
_EXIT_WAIT = 2.0  # seconds the exit hook waits for its kill requests
RAY_WARM_THREAD = "mprs_plus ray warm"

Key = tuple[Any, ...]


def pool_key(backend: Any, per_actor_env: bool) -> Key:
    """What an actor was made with, as far as a next service could tell it apart."""
    strategy = backend.scheduling_strategy
    if strategy is not None and not isinstance(strategy, str):
        # A strategy object: its type and fields (an object that prints its address never
        # matches another, and its actors are never reused: the safe side).
        fields = getattr(strategy, "__dict__", None)
        strategy = (type(strategy).__qualname__, repr(sorted(fields.items())) if fields else repr(strategy))
    return (
        ray.get_runtime_context().get_job_id(),
        json.dumps(backend.runtime_env, sort_keys=True, default=repr),
        per_actor_env,
        float(backend.num_cpus_per_worker),
        tuple(sorted((backend.resources or {}).items())),
        strategy,
    )


@dataclass
class _Idle:
    actor: Any
    started: Any  # a call's answer that came once the actor had started
    expires: float  # time.monotonic() when it is ended unused


class WarmPool:
    """The idle actors of this process, by key (see the module docstring)."""

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._idle: dict[Key, list[_Idle]] = {}
        self._holding = False  # counted as a user of a connection made here
        self._reaper: threading.Thread | None = None
        self._hooked = False
        self._exiting = False  # the exit hook ran: a service stopped later kills its actors

    def accepts(self) -> bool:
        """Actors given back now are kept (not once the interpreter is exiting)."""
        return not self._exiting

    def take(self, key: Key) -> tuple[Any, Any] | None:
        """An idle actor of ``key`` that is alive, and the answer of its ``where`` call;
        None when there is none."""
        while True:
            with self._cv:
                entries = self._idle.get(key)
                if not entries:
                    break
                entry = entries.pop()  # the latest given back: the warmest
                if not entries:
                    del self._idle[key]
            try:
                # A pre-started actor may still be importing what a child runs: its child's
                # setup must not be unpickled meanwhile (torch imported in two threads at
                # once fails), so it is waited for, as long as a new actor may take to start.
                started, _ = ray.wait([entry.started], timeout=STARTING_WAIT)
                if started:
                    get_without_cycle(entry.started, timeout=0)
                    where = entry.actor.where.remote()
                    answered, _ = ray.wait([where], timeout=TAKE_WAIT)
                    if answered:
                        get_without_cycle(where, timeout=0)
                        return entry.actor, where
            except Exception:
                pass  # dead while idle (or Ray failed): never handed out
            _kill_soon([entry.actor])
        self._settle()
        return None

    def give(self, key: Key, actor: Any, started: Any, keep_for: float) -> None:
        """Keep ``actor`` (idle) for ``keep_for`` seconds for a next service of ``key``."""
        hold = False
        with self._cv:
            self._idle.setdefault(key, []).append(_Idle(actor, started, time.monotonic() + keep_for))
            if not self._holding and connection.made_here():
                self._holding = hold = True
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, name=RAY_WARM_THREAD, daemon=True)
                self._reaper.start()
            if not self._hooked:
                self._hooked = True
                atexit.register(self._at_exit)
            self._cv.notify_all()
        if hold:
            connection.hold()

    def has_other_than(self, key: Key) -> bool:
        with self._cv:
            return any(k != key for k in self._idle)

    def end_others(self, key: Key) -> None:
        """Kill the idle actors of every key but ``key`` (without waiting for them)."""
        with self._cv:
            others = [k for k in self._idle if k != key]
            ended = [entry.actor for k in others for entry in self._idle.pop(k)]
        _kill_soon(ended)

    def idle(self, key: Key | None = None) -> int:
        """How many actors are idle (of ``key``, or all)."""
        with self._cv:
            if key is not None:
                return len(self._idle.get(key, ()))
            return sum(len(entries) for entries in self._idle.values())

    def close(self, key: Key | None = None, wait: float = _CLOSE_WAIT) -> None:
        """Kill the idle actors (of ``key``, or all) and wait, at most ``wait`` seconds in
        all, until Ray reports each gone."""
        with self._cv:
            keys = [key] if key is not None else list(self._idle)
            ended = [entry.actor for k in keys for entry in self._idle.pop(k, ())]
        deadline = time.monotonic() + wait
        helpers = [_in_helper(lambda actor=actor: _kill_and_wait(actor, deadline)) for actor in ended]
        for helper in helpers:
            helper.join(max(0.0, deadline - time.monotonic()))
        self._settle()

    def _reap(self) -> None:
        """The reaper: kills each actor once idle for its time; ends with the pool."""
        while True:
            with self._cv:
                if not self._idle:
                    self._reaper = None
                    break
                now = time.monotonic()
                expired: list[Any] = []
                for k in list(self._idle):
                    kept = [entry for entry in self._idle[k] if entry.expires > now]
                    expired += [entry.actor for entry in self._idle[k] if entry.expires <= now]
                    if kept:
                        self._idle[k] = kept
                    else:
                        del self._idle[k]
                if not expired:
                    first = min(entry.expires for entries in self._idle.values() for entry in entries)
                    self._cv.wait(max(0.01, first - now))  # give() wakes it: a sooner expiry
                    continue
            _kill_soon(expired)
        self._settle()

    def _settle(self) -> None:
        """An empty pool is no user of the connection any more."""
        with self._cv:
            release = self._holding and not self._idle
            if release:
                self._holding = False
        if release:
            connection.detach()

    def _at_exit(self) -> None:
        self._exiting = True
        self.close(wait=_EXIT_WAIT)


def _kill(actor: Any) -> None:
    with contextlib.suppress(Exception):
        ray.kill(actor, no_restart=True)


def _kill_soon(actors: list[Any]) -> None:
    """Ask Ray to kill each actor, each in a helper thread (a kill may wait on the control
    store in native code): nothing here waits for them."""
    for actor in actors:
        _in_helper(lambda actor=actor: _kill(actor))


def _kill_and_wait(actor: Any, deadline: float) -> None:
    """Kill ``actor``, then wait until Ray has it dead, at most until ``deadline``."""
    _kill(actor)
    wait_dead(actor, deadline)


_PROBE_EVERY = 0.05  # seconds between probes of an actor being killed


def wait_dead(actor: Any, deadline: float) -> bool:
    """Whether a call to ``actor`` failed (Ray has it dead) before ``deadline``.

    A kill travels through the control store while a call goes straight to the actor: a
    call sent after ``ray.kill`` may still be answered. So one answered probe proves
    nothing; probes are sent until one fails, ``_PROBE_EVERY`` s apart, up to the deadline.
    """
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        probe = actor.where.remote()
        answered, _ = ray.wait([probe], timeout=left)
        if not answered:
            return False
        try:
            get_without_cycle(probe, timeout=0)
        except Exception:
            return True
        time.sleep(min(_PROBE_EVERY, max(0.0, deadline - time.monotonic())))  # Ray tells no one


def _in_helper(call: Callable[[], Any]) -> threading.Thread:
    return in_helper(call, RAY_WARM_THREAD)


pool = WarmPool()
