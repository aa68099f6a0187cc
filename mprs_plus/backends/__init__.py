"""Where the children of a service run, and the channels between them: a backend.

    backend (the user's choice, an option)  --open(ctx)-->  Placement (one per service)
        Placement.open_channel(...)  -> (sender, receiver)    the transport.Sender/Receiver interface
        Placement.start(name, target, setup) -> process       what the supervisor starts and watches
        Placement.death_error(processes) -> Exception         a child gone unasked, in the user's words
        Placement.node_of(process) -> str | None              where a child runs, for stats()
        Placement.refresh_stats(table, links)                 children elsewhere: copy their rows here
        Placement.refused_connections(process) -> int         strangers its ports turned away, for stats()
        Placement.close()                                     after every child is stopped

The plan, the topology, the child loop and the main-process reader are the same for every
backend; a placement only says on what a child runs and over what its channels go. A
"process" here is anything with the ``multiprocessing.Process`` members the supervisor uses
(``name``, ``pid``, ``sentinel``, ``exitcode``, ``join``, ``terminate``, ``kill``): a local
process is one, a Ray actor is wrapped as one (``ray/placement.py``).

``LocalBackend`` (the default) is processes on this host over the shared-memory transport;
``RayBackend`` runs them as Ray actors on a cluster's nodes. Importing this package imports
no Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..transport import Receiver, Sender
from .local import LocalBackend, LocalPlacement

__all__ = ["Backend", "LocalBackend", "LocalPlacement", "Placement", "RayBackend"]


class Placement(Protocol):
    """Where one service's children run and over what their channels go (see above)."""

    start_at_once: bool  # start every child in start(), even under fork
    on_this_host: bool  # the children share this host's memory (semaphores, shared counters)

    def open_channel(
        self, *, capacity_items: int, capacity_bytes: int, control: bool = False, refill_at_half: bool = False
    ) -> tuple[Sender, Receiver]: ...

    def start(self, name: str, target: Callable[[Any], None], setup: Any) -> Any: ...

    def death_error(self, processes: Sequence[Any]) -> Exception: ...

    def node_of(self, process: Any) -> str | None: ...

    def refresh_stats(self, table: Any, links: Sequence[Any]) -> None: ...

    def refused_connections(self, process: Any) -> int: ...

    def close(self) -> None: ...


class Backend(Protocol):
    """What ``backend=`` takes: ``open(ctx)`` gives the placement of one service."""

    def open(self, ctx: Any) -> Placement: ...


def __getattr__(name: str) -> Any:
    if name == "RayBackend":
        from .ray import RayBackend

        return RayBackend
    raise AttributeError(f"module 'mprs_plus.backends' has no attribute {name!r}")
