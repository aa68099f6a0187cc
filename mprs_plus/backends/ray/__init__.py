"""The Ray backend: the worker and dispatch segments run as Ray actors on a cluster's
nodes; the main segment stays in the training process.

    MultiProcessingReadingService(num_workers=16, backend=RayBackend(address="auto"))

The actors run the same child loop as local processes (``runtime/child``); only where a
child runs (``placement.py``, ``actor.py``) and the channels between processes
(``channel.py``) are Ray's. This module imports no Ray: ``RayBackend(...)`` checks that it
is installed, and the rest loads when a service starts.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse


def install_hint(extra: str = "ray") -> str:
    """The pip command that adds ``extra`` to mprs_plus as it is installed here.

    ``pip install 'mprs_plus[ray]'`` only works where pip can find the package by name. The
    README installs from a checkout (``pip install -e .``): there the extra is asked of that
    directory. A copy installed from a directory names it (pip records it in
    ``direct_url.json``); only a copy from an index gets the package's name.
    """
    checkout = Path(__file__).resolve().parents[3]
    if (checkout / "setup.py").is_file():  # this code runs from a source tree
        return f"pip install -e '{checkout}[{extra}]'"
    try:
        recorded = importlib.metadata.distribution("mprs_plus").read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        recorded = None
    if recorded:
        origin = json.loads(recorded)
        url = urlparse(origin.get("url", ""))
        if "dir_info" in origin and url.scheme == "file":
            return f"pip install '{unquote(url.path)}[{extra}]'"
    return f"pip install 'mprs_plus[{extra}]'"


@dataclass(frozen=True)
class RayBackend:
    """Run the service's worker (and dispatch) segments as Ray actors.

    Args:
        address: the cluster to attach to: ``"auto"`` (the one ``ray start`` runs on this
            machine, or ``RAY_ADDRESS``), an address such as ``"ray://head:10001"`` or
            ``"10.0.0.1:6379"``, or None to start a Ray of this machine for the service and
            stop it at shutdown (once its warm actors are done, ``warm_for``). If Ray is
            already initialized in this process, that connection is used whatever
            ``address`` says, and left as it was at shutdown.
            A cluster attached to is never stopped.
        num_cpus_per_worker: CPUs each actor reserves on its node (Ray's ``num_cpus``).
        resources: Ray custom resources each actor reserves, e.g. ``{"preprocess": 1}`` to
            pin workers on nodes started with ``--resources='{"preprocess": 8}'``.
        scheduling_strategy: Ray's scheduling strategy for the actors, e.g. ``"SPREAD"`` to
            spread them over the nodes, or a ``NodeAffinitySchedulingStrategy``.
        runtime_env: Ray's runtime environment of the actors: how the pipeline's own code
            reaches the nodes (``{"working_dir": "."}`` or ``{"py_modules": [my_pkg]}``),
            plus packages or environment variables. Ray uploads local directories only
            for a whole job: when Ray is already initialized in this process, pass such a
            runtime_env to your ``ray.init`` instead.
        num_cpus: with ``address=None``, the CPUs of the Ray started here (None: all).
        log_to_driver: show the actors' stdout and stderr in this process.
        landing: items of actors on other nodes land in this node's shared memory through a
            small process of this node that reads their streams (one per such worker), so
            the training process reads them as it reads a local worker's, without copying
            each byte out of a socket. False: the training process reads the sockets
            itself (no extra process; each byte's copy out of the kernel then costs the
            training loop's process, about a memcpy's time).
        listen_interface: the network interface (e.g. ``"eth1"``) on which every actor
            listens for its peers' connections, on each node its IPv4 address; None: the
            address Ray uses for the node. A node without it is an error saying so.
        warm_for: seconds an actor that a service no longer needs (an epoch of
            ``persistent_workers=False``, a loader shut down) waits in this process, idle,
            for the next service with these settings, which then takes it instead of
            starting a new one: no process start, no torch import. It hosts a new worker
            from scratch (the dataset as the loader holds it now, the epoch's seeds,
            ``worker_init_fn`` again). 0: every service starts its own actors and kills
            them at its end. While actors wait, they hold their CPUs and resources on the
            cluster, and the Ray connection (a Ray started here) stays; ``close()`` ends
            them at once, and they end at the latest with this process.
    """

    address: str | None = "auto"
    num_cpus_per_worker: float = 1
    resources: Mapping[str, float] | None = None
    scheduling_strategy: Any = None
    runtime_env: Mapping[str, Any] | None = None
    num_cpus: int | None = None
    log_to_driver: bool = True
    landing: bool = True
    listen_interface: str | None = None
    warm_for: float = 60.0

    def __post_init__(self) -> None:
        try:
            found = importlib.util.find_spec("ray") is not None
        except ValueError:  # a module "ray" without a spec (set to None in sys.modules, say)
            found = False
        if not found:
            raise ImportError(f"the Ray backend needs Ray, which is not installed: {install_hint('ray')}")
        if self.address is not None and not isinstance(self.address, str):
            raise TypeError(f"address must be a string such as 'auto', or None; got {type(self.address).__name__}")
        if self.listen_interface is not None and (not isinstance(self.listen_interface, str) or not self.listen_interface):
            raise TypeError(f"listen_interface must be an interface's name such as 'eth1', or None; got {self.listen_interface!r}")
        cpus = self.num_cpus_per_worker
        if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or cpus < 0:
            raise ValueError(f"num_cpus_per_worker must be a number >= 0, got {cpus!r}")
        warm = self.warm_for
        if isinstance(warm, bool) or not isinstance(warm, (int, float)) or not 0 <= warm < float("inf"):
            raise ValueError(f"warm_for must be a number of seconds >= 0 (0: no warm actors), got {warm!r}")

    def open(self, ctx: Any) -> Any:
        """The placement of one running service (connects to Ray, or starts it)."""
        del ctx
        from .placement import RayPlacement

        return RayPlacement(self)

    def prestart(self, count: int) -> None:
        """Start ``count`` actors now, without waiting for them: they start (and import
        torch) while this process does something else, such as loading the model, and
        the next services with these settings take them as warm actors. They wait at
        most ``warm_for`` seconds from now. Connects to Ray as a service would."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"prestart(count): count must be an int >= 0, got {count!r}")
        if self.warm_for <= 0:
            raise ValueError("prestart() keeps its actors as warm actors: it needs warm_for > 0")
        from .placement import RayPlacement
        from .warm import pool

        placement = RayPlacement(self)
        try:
            for _ in range(count):
                actor = placement.new_actor("a pre-started actor")
                pool.give(placement.key, actor, actor.prepare.remote(), self.warm_for)
        finally:
            placement.close()

    def close(self) -> None:
        """End this backend's warm actors now (those of its settings that wait idle), and
        wait, bounded, until Ray reports them gone. Services still running keep theirs."""
        import ray

        if not ray.is_initialized():
            return
        from .placement import RayPlacement
        from .warm import pool

        placement = RayPlacement(self)
        try:
            pool.close(placement.key)
        finally:
            placement.close()


__all__ = ["RayBackend"]
