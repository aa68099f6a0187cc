"""The Ray actor that hosts one child: it runs the same child body as a local process
(``worker_main`` / ``dispatch_main``) in one of its threads, and serves the calls of its
channels (``channel.py``): deliveries to its control receiver, and ``listen`` for the data
channels whose listening end it hosts (their items then travel over those connections).

An actor may host one child after another (warm actors, ``warm.py``): each child's
channel ends and control boxes are let go of when it ends.

Defined when first needed, so that importing this module never starts Ray."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import ray

from ...transport.stream import refused_connections
from . import channel


class SegmentHost:
    """One child of a service, on some node of the cluster."""

    def __init__(self) -> None:
        # torchdata warns that its DataPipes are deprecated when first imported. The training
        # process has shown that once, and a forked local worker inherits that; an actor
        # imports torchdata afresh (unpickling its segment, after this) and Ray would show it
        # once per actor. Only that warning: the worker's own prints and warnings still pass.
        for module in ("torchdata.datapipes", "torchdata.dataloader2"):
            warnings.filterwarnings("ignore", category=UserWarning, module=re.escape(module) + r"\Z")

    def where(self) -> dict[str, Any]:
        context = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }

    def run(self, target: Callable[[Any], None], setup: Any, stats_rows: tuple[int, ...] = ()) -> None:
        """The child's whole life: returns when its loop ends (the service stopped it).
        Errors raised here name the node: "worker process 1 (pid 7, node ...)".

        ``stats_rows``: the rows of the service's statistics table this child's lanes
        write. The table is shared memory of the training process's host, which Ray cannot
        carry: the lanes write a table of this process instead, which ``stats`` reads."""
        import multiprocessing

        from ...runtime import data_messages
        from ...runtime.stats import StatsTable

        where = self.where()
        data_messages.NODE = f"{where['ip']}, node id {where['node_id'][:12]}"
        self._table = None
        if stats_rows:
            self._table = StatsTable(multiprocessing.get_context(), max(stats_rows) + 1)
            setup = setup._replace(stats=tuple(self._table.writer(row) for row in stats_rows))
        try:
            target(setup)
        finally:
            _let_go(setup)
            # A warm actor hosts one child after another (``warm.py``): the next one counts
            # the connections refused from now on (its listeners are made, and may refuse
            # strangers, before its run begins).
            self._refused_before = refused_connections()

    def prepare(self) -> bool:
        """Import what a child runs (torch among it): a pre-started actor does it while
        the training process does something else (``RayBackend.prestart``)."""
        from ...runtime.child import dispatch, worker  # noqa: F401

        return True

    def stats(self, rows: tuple[int, ...]) -> tuple[float, list[dict[str, float]], int]:
        """This child's statistics rows, with its clock's time now (the training process's
        clock may differ: another host), and the connections its listeners refused (they
        did not prove the secret) since the child before it ended: this process hosts
        one child at a time, so all are its."""
        table = getattr(self, "_table", None)
        refused = refused_connections() - getattr(self, "_refused_before", 0)
        if table is None:
            return time.monotonic(), [], refused
        return time.monotonic(), [table.read(row) for row in rows], refused

    def deliver(self, cid: str, seq: int, message: Any, last: bool) -> None:
        channel.serve_deliver(cid, seq, message, last)

    def listen(self, specs: list[Any], senders: Sequence[bool] = (), interface: str | None = None) -> list[Any]:
        """Listen for the peers of the data channels whose ends this child will use, on
        this node's address as Ray reports it or that of the network ``interface`` named
        (and, for its sending ends, on a Unix-domain socket for a peer on this node); the
        addresses, for the peers to connect."""
        return channel.listen_here(specs, senders, interface)


def _let_go(setup: Any) -> None:
    """The child ended: let go of its channel ends (their sockets, listeners, shared
    memory) and of its control boxes, so that a next child of this actor starts from
    what a new process has, and nothing of this one accumulates."""
    from ...transport.stream import close_listeners

    def visit(value: Any) -> None:
        if isinstance(value, (tuple, list)):
            for item in value:
                visit(item)
        elif isinstance(value, channel.RayReceiver):
            channel.drop_box(value)
        elif hasattr(value, "release") and hasattr(value, "traffic"):  # a channel end
            with contextlib.suppress(Exception):
                value.release()

    for value in setup:
        visit(value)
    close_listeners()  # a listener whose end was never used (its child stopped first)


_remote_class: Any = None


def remote_class() -> Any:
    global _remote_class
    if _remote_class is None:
        # Not restarted, its calls not retried: a child's state (epoch, position) cannot be
        # rebuilt by Ray, so a lost actor is an error of the service (``placement.py``).
        _remote_class = ray.remote(max_restarts=0, max_task_retries=0)(SegmentHost)
    return _remote_class
