"""This process's connection to Ray, as the backend makes and ends it.

    attach(backend)  a user of the connection: Ray initialized here if it is not yet
                     (``address``, ``runtime_env``); True when this module made it
    detach()         that user is done: the last one of a connection made here
                     disconnects (``ray.shutdown``: a Ray started here stops with it,
                     a cluster attached to goes on)

Users are the running services (their placements) and, while it keeps idle actors on a
connection made here, the pool of warm actors (``warm.py``): a connection ends when the
last of them is done, since its actors end with it (Ray's owner death). A connection the
user made (``ray.init`` before any service) is never ended here. One lock orders every
attach and detach, whichever thread runs it (the pool's reaper detaches in its own).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import ray


class _Ours:
    """Whether this process's Ray connection was made here, and how many users it has."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.started = False
        self.users = 0


_ours = _Ours()


def attach(backend: Any) -> bool:
    """Count one user of this process's Ray connection, connecting first if there is none
    (``ConnectionError`` saying what to do when that fails). True when the connection is
    one this module made (the caller must ``detach`` once done), False for the user's own."""
    with _ours.lock:
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"address": backend.address, "log_to_driver": backend.log_to_driver}
            if backend.runtime_env is not None:
                # For the whole job: Ray uploads local directories (working_dir, py_modules)
                # only from ray.init, never for one actor.
                kwargs["runtime_env"] = dict(backend.runtime_env)
            if backend.address is None:
                # "local": a new Ray of this machine, even where `ray start` runs one already.
                kwargs.update(address="local", num_cpus=backend.num_cpus, include_dashboard=False)
            try:
                ray.init(**kwargs)
            except Exception as exc:
                where = "a new local Ray" if backend.address is None else f"Ray at address={backend.address!r}"
                raise ConnectionError(
                    f"the Ray backend could not start or reach {where}: {first_line(exc)}. Start a cluster "
                    "(`ray start --head` here, `ray start --address=HEAD:6379` on the other nodes), pass its "
                    "address, or address=None for a Ray of this machine."
                ) from None
            _ours.started = True
        if _ours.started:
            _ours.users += 1
        return _ours.started


def made_here() -> bool:
    """The connection in use was made by this module (a user of it must count itself)."""
    with _ours.lock:
        return _ours.started and ray.is_initialized()


def hold() -> None:
    """One more user of a connection made here (the pool, while it keeps actors)."""
    with _ours.lock:
        _ours.users += 1


def detach() -> None:
    """One user of a connection made here is done; the last one disconnects."""
    with _ours.lock:
        _ours.users -= 1
        if _ours.users == 0:
            _ours.started = False
            with contextlib.suppress(Exception):
                ray.shutdown()  # a Ray started here stops with it; a cluster attached to goes on


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return next((line.strip() for line in text if line.strip()), type(exc).__name__)
