"""The Ray comparison's workloads and contenders: the same items through mprs_plus on Ray
actors, through local mprs_plus, and through Ray Data, on a simulated two-node cluster.

    ray_compare.py --> LocalCluster.start()      two raylets on this machine, one CPU each
                   --> workloads(cluster)        tiny items, 1 MiB arrays, 2 ms CPU work
                         runner per contender -> harness.stream(open_loader)
                   --> LocalCluster.stop()

Every contender makes item ``i`` with the same function as the suite's workloads
(``_shared``): ``mprs_plus`` and ``mprs_plus-ray`` run ``range -> sharding_filter -> map(fn)``
in two workers, local processes or Ray actors; ``ray-data`` runs
``ray.data.range(n).map(...)`` and reads ``iter_rows()``, one row (a dict holding the item)
at a time, as a training loop without batching reads a DataLoader2.

Ray is optional: ``ray_missing()`` and ``ray_backend_missing()`` say why a contender cannot
run, and the comparison records it as n/a with that reason.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from .. import harness
from ._shared import burn, identity, mapped_range, numpy_array

ROOT = Path(__file__).resolve().parents[2]

# DataLoader2 + MultiProcessingReadingService(backend=RayBackend(...)), its workers on the
# other node (their items come over the network's streams) or on the training process's
# node (shared-memory rings handed over to the actors).
RAY_BACKEND = "mprs_plus-ray"
RAY_NEAR = "mprs_plus-ray-near"
# RAY_BACKEND whose actors are warm (``RayBackend.warm_for``): an untimed loader before
# the timed one started them, as an earlier epoch or loader of the same driver would.
RAY_WARM = "mprs_plus-ray-warm"
LOCAL = "mprs_plus"  # the same service with local worker processes
RAY_DATA = "ray-data"  # ray.data.range(n).map(...).iter_rows()
CONTENDERS = (RAY_BACKEND, RAY_NEAR, RAY_WARM, LOCAL, RAY_DATA)
RAY_BACKENDS = (RAY_BACKEND, RAY_NEAR, RAY_WARM)
RAY_CONTENDERS = (*RAY_BACKENDS, RAY_DATA)
# Custom resources that tell the nodes apart: the head runs the training process.
TRAINER_NODE, OTHER_NODE = "trainer_node", "other_node"
_NODE_OF = {RAY_BACKEND: OTHER_NODE, RAY_NEAR: TRAINER_NODE, RAY_WARM: OTHER_NODE}

# Metrics of every workload (see ``stream_epoch``). Throughput is in items/s everywhere;
# GB/s is derived from it where items have a size. The cluster is running before any is timed.
THROUGHPUT = harness.Metric("throughput", "items/s")
EPOCH_THROUGHPUT = harness.Metric("epoch_throughput", "items/s")
MAIN_CPU_PER_ITEM = harness.Metric("main_cpu_per_item", "s", higher_is_better=False)
FIRST_ITEM = harness.Metric("first_item", "s", higher_is_better=False)
METRICS = (THROUGHPUT, EPOCH_THROUGHPUT, MAIN_CPU_PER_ITEM, FIRST_ITEM)


def ray_missing() -> str | None:
    """Why Ray (with Ray Data) cannot run here, or None when it can."""
    try:
        import ray  # noqa: F401
        import ray.data  # noqa: F401
        from ray.cluster_utils import Cluster  # noqa: F401
    except ImportError as exc:
        return f"ray is not installed ({exc}); 'pip install -e .[bench]' brings Ray with Ray Data"
    return None


def ray_backend_missing() -> str | None:
    """Why the Ray backend of mprs_plus cannot run here, or None when it can."""
    why = ray_missing()
    if why:
        return why
    try:
        from mprs_plus import RayBackend  # noqa: F401
    except ImportError as exc:
        return f"mprs_plus.RayBackend is not importable ({exc})"
    return None


# -- the cluster ------------------------------------------------------------------------------


class LocalCluster:
    """Two Ray nodes on this machine (``ray.cluster_utils.Cluster``), this process their driver.

    Each node has one CPU, so two workers (or Ray Data's two tasks) run one per node. The
    nodes' processes are children of this one: ``processes()`` names them, so that the
    comparison's check for leftover processes leaves the cluster alone.
    """

    def __init__(self, nodes: int = 2, cpus_per_node: int = 1, object_store_mib: int = 1024) -> None:
        self.nodes = nodes
        self.cpus_per_node = cpus_per_node
        # A node of ``Cluster`` gets a test-sized object store (150 MB) unless told; a real
        # node takes 30% of its memory. Ray Data's blocks of 1 MiB arrays would spill to disk
        # in 150 MB, which no real node would do.
        self.object_store_mib = object_store_mib
        self.address: str | None = None
        self.start_s = 0.0
        self._cluster: Any = None
        self._pids: set[int] = set()

    def start(self) -> LocalCluster:
        import ray
        from ray.cluster_utils import Cluster

        # The nodes run on this machine and inherit this environment: the benchmark's own
        # modules (which Ray Data's tasks and the workers import by name) are found through
        # PYTHONPATH. On a real cluster a runtime_env ships them (docs/ray.md).
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        logging.getLogger("ray").setLevel(logging.WARNING)  # its start-up notes would split the table
        started = time.perf_counter()
        node = {"num_cpus": self.cpus_per_node, "object_store_memory": self.object_store_mib * harness.MiB}
        head = dict(node, resources={TRAINER_NODE: 1.0})
        self._cluster = Cluster(initialize_head=True, head_node_args=head)
        try:
            for _ in range(self.nodes - 1):
                self._cluster.add_node(**node, resources={OTHER_NODE: 1.0})
            self._cluster.wait_for_nodes()
            ray.init(address=self._cluster.address, log_to_driver=False, logging_level=logging.WARNING)
            _quiet_ray_data()
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - started
        self.address = self._cluster.address
        self._pids = {p.pid for p in psutil.Process().children(recursive=False)}
        return self

    @property
    def cpus(self) -> float:
        return float(self.nodes * self.cpus_per_node)

    def processes(self) -> set[int]:
        """The cluster's own processes (its nodes' daemons), direct children of this one."""
        return set(self._pids)

    def idle_within(self, seconds: float) -> str | None:
        """Wait (bounded) until every CPU of the cluster is free again; the problem, or None.

        A contender whose actors or tasks still hold CPUs after its shutdown would slow, or
        stall, the next measurement: that is reported beside its figures.
        """
        import ray

        deadline_at = time.monotonic() + seconds
        free = 0.0
        while time.monotonic() < deadline_at:
            free = float(ray.available_resources().get("CPU", 0.0))
            if free >= self.cpus:
                return None
            time.sleep(0.1)  # not a synchronisation: a bounded look at what Ray reports
        return f"{self.cpus - free:g} of the cluster's {self.cpus:g} CPUs still held {seconds:g} s after shutdown"

    def stop(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if self._cluster is not None:
            self._cluster.shutdown()
            self._cluster = None

    def describe(self) -> str:
        return (
            f"{self.nodes} simulated nodes on this machine (ray.cluster_utils.Cluster), "
            f"{self.cpus_per_node} CPU and {self.object_store_mib} MiB of object store each"
        )


def _quiet_ray_data() -> None:
    # Progress bars and per-execution log lines would interleave with the table.
    import ray.data

    logging.getLogger("ray.data").setLevel(logging.ERROR)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False


# -- contenders -------------------------------------------------------------------------------


def stream_epoch(open_: Callable[[], harness.Loader], *, items: int, settings: harness.Settings) -> dict[str, Any]:
    """Stream one whole epoch of ``items`` items from a new loader, and time it.

    Unlike ``harness.stream`` this never stops early: Ray Data runs ahead of its reader
    with nothing to hold it back, so items read in a window right after the first one may
    have been made during the start-up, and a rate over that window alone would count them
    as made at reading speed. The whole epoch, from creating the loader, cannot be inflated
    that way. Returns:

    * ``throughput``: items/s over the second half of the epoch (steady state: what a
      loader ran ahead during its start-up is read in the first half, if the epoch is long
      enough; the epoch rate below is the bound that holds whatever the epoch's length);
    * ``epoch_throughput``: items/s from creating the loader to the last item, start-up
      included;
    * ``first_item``: seconds from creating the loader to its first item;
    * ``main_cpu_per_item``: the main process's CPU time per item over the steady window
      (every thread of it: a Ray driver's threads count).
    """
    clock, cpu_clock = time.perf_counter, time.process_time
    warm_items = max(1, items // 2)
    count = 0
    first = start = cpu_start = 0.0
    created = clock()
    loader = open_()
    item: Any = None
    try:
        for item in loader:
            count += 1
            if count <= warm_items:
                if count == 1:
                    first = clock()
                if count == warm_items:
                    start, cpu_start = clock(), cpu_clock()
        end, cpu_end = clock(), cpu_clock()
        item = None  # drop the last item before the loader stops, as a training loop would
    except BaseException:
        item = None
        harness.close_within(loader, settings)
        raise
    problem = harness.close_within(loader, settings)
    if count != items:
        raise RuntimeError(f"the epoch yielded {count} items, expected {items}")
    timed = count - warm_items
    if timed < 1:
        raise RuntimeError(f"too few items ({count}) to time after the warm-up")
    result: dict[str, Any] = {
        "throughput": timed / (end - start),
        "epoch_throughput": count / (end - created),
        "first_item": first - created,
        "main_cpu_per_item": (cpu_end - cpu_start) / timed,
        "epoch_s": end - created,
    }
    if problem:
        result["problems"] = [f"after the epoch: {problem}"]
    return result


class RowFn:
    """Ray Data's row function: ``{"item": fn(id)}`` for the row ``{"id": id}`` of ``range``."""

    def __init__(self, fn: Callable[[int], Any]) -> None:
        self.fn = fn

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        return {"item": self.fn(row["id"])}


def open_ray_data(n: int, fn: Callable[[int], Any]) -> harness.Loader:
    """``ray.data.range(n).map(...)`` read row by row; ``close()`` stops its execution."""
    import ray.data

    rows = iter(ray.data.range(n).map(RowFn(fn)).iter_rows())

    def close() -> None:
        # Closing the row generator ends the streaming execution behind it (its tasks stop
        # and their CPUs come back; ``LocalCluster.idle_within`` checks that they do).
        rows.close()

    return harness.Loader(rows, close)


def ray_backend(settings: harness.Settings, address: str, node: str, warm_for: float = 0) -> Any:
    """The workers all on ``node`` (a custom resource of one node): half a CPU each, so that
    both fit on a node of one CPU, as Ray Data's two tasks fit on two."""
    from mprs_plus import RayBackend

    share = 1.0 / max(1, settings.num_workers)
    return RayBackend(address=address, num_cpus_per_worker=share, resources={node: share}, warm_for=warm_for)


def open_ray_backend(settings: harness.Settings, pipe: Any, backend: Any) -> harness.Loader:
    from torchdata.dataloader2 import DataLoader2

    from mprs_plus import MultiProcessingReadingService

    service = MultiProcessingReadingService(settings.num_workers, backend=backend)
    loader = DataLoader2(pipe, reading_service=service)
    return harness.Loader(loader, loader.shutdown)


def warm_up(settings: harness.Settings, backend: Any, fn: Callable[[int], Any]) -> None:
    """An untimed loader of a few items: its actors then wait, warm, for the next one."""
    loader = open_ray_backend(settings, mapped_range(4 * settings.num_workers, fn), backend)
    try:
        for _ in loader:
            pass
    finally:
        harness.close_within(loader, settings)


def open_contender(
    contender: str, settings: harness.Settings, n: int, fn: Callable[[int], Any], cluster: LocalCluster | None
) -> harness.Loader:
    if contender == LOCAL:
        return harness.open_loader(harness.MPRS_PLUS, settings, pipe=mapped_range(n, fn))
    if cluster is None or cluster.address is None:
        raise RuntimeError(f"{contender} needs the Ray cluster, which is not running")
    if contender in (RAY_BACKEND, RAY_NEAR):
        # Each measurement starts its actors (warm_for=0): the next contender, Ray Data
        # among them, gets every CPU of the cluster.
        backend = ray_backend(settings, cluster.address, _NODE_OF[contender])
        return open_ray_backend(settings, mapped_range(n, fn), backend)
    if contender == RAY_DATA:
        return open_ray_data(n, fn)
    raise ValueError(f"unknown contender {contender!r}; choose from {CONTENDERS}")


# -- workloads --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    title: str
    description: str
    items: Callable[[harness.Settings], int]
    make_fn: Callable[[harness.Settings], Callable[[int], Any]]
    item_bytes: int = 0


CASES = (
    Case(
        "tiny_items",
        "tiny items",
        "ints 0..n through an identity map; per-item transport overhead",
        items=lambda s: 20_000 if s.quick else 400_000,
        make_fn=lambda s: identity,
    ),
    Case(
        "numpy_arrays",
        "1 MiB numpy arrays",
        "np.full of 1 MiB (uint8) made in the workers; bytes delivered to the main process",
        items=lambda s: 128 if s.quick else 4096,
        make_fn=lambda s: functools.partial(numpy_array, nbytes=harness.MiB),
        item_bytes=harness.MiB,
    ),
    Case(
        "cpu_bound",
        "2 ms CPU work",
        "a pure-Python loop of about 2 ms per item in the workers (GIL held)",
        items=lambda s: 100 if s.quick else 6000,
        make_fn=lambda s: functools.partial(burn, loops=s.cpu_loops),
    ),
)


def workloads(cluster: LocalCluster | None, cases: tuple[Case, ...] = CASES) -> list[harness.Workload]:
    """One ``harness.Workload`` per case, with a runner for each of CONTENDERS."""

    def run(case: Case, contender: str, settings: harness.Settings) -> dict[str, Any]:
        n, fn = case.items(settings), case.make_fn(settings)
        if contender == RAY_WARM:
            if cluster is None or cluster.address is None:
                raise RuntimeError(f"{contender} needs the Ray cluster, which is not running")
            backend = ray_backend(settings, cluster.address, _NODE_OF[contender], warm_for=60)
            try:
                warm_up(settings, backend, fn)
                return stream_epoch(lambda: open_ray_backend(settings, mapped_range(n, fn), backend), items=n, settings=settings)
            finally:
                backend.close()  # the cluster's CPUs back for the next contender
        return stream_epoch(lambda: open_contender(contender, settings, n, fn, cluster), items=n, settings=settings)

    return [
        harness.Workload(
            name=case.name,
            title=case.title,
            description=case.description,
            metrics=METRICS,
            runners={c: functools.partial(run, case, c) for c in CONTENDERS},
        )
        for case in cases
    ]


def item_bytes(workload_name: str) -> int:
    return next(c.item_bytes for c in CASES if c.name == workload_name)
