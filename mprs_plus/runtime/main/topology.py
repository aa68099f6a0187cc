"""Who talks to whom: the processes of a service and their channels, as named fields.

    main --control--> dispatch      (only when the plan has dispatchers)
    main --control--> worker w
    worker w, output k --data--> main          ChildLink.data[k]
    dispatcher d --data--> worker w            (between children: the main process keeps no end)

``plan_topology`` computes the shape purely from the Plan: which children exist, their
names, how many lanes each runs and which statistics rows those lanes write. The
service's wiring (``service._wire_children``) then fills in every link's endpoints, in one
place, and freezes the topology: a later write of an endpoint is an internal error. The
supervisor attaches each link's process, once, when it starts it.
Nothing else in the main process counts positions: a worker's data receivers are
``link.data``, the dispatch process is ``topology.dispatch``, a lane's statistics row is
``link.stats_rows[k]``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ...plan import Plan
from ...segment import Segment
from ...transport import Receiver, Sender


_ENDPOINTS = frozenset({"control", "data"})


class ChildLink:
    """One child process as the main process sees it.

    ``role``, ``index``, ``name``, ``lanes`` and ``stats_rows`` come from the plan; the
    endpoints are filled in by the wiring and frozen with the topology; ``process`` is
    attached by the supervisor when it starts the child, once, and retired
    (replaced by its record) once the child is reaped.

    A plain class rather than a dataclass, as the other records on the way to a first item
    are: a dataclass compiles its methods when its module loads.
    """

    __slots__ = ("role", "index", "name", "lanes", "stats_rows", "control", "data", "process", "_wired")

    def __init__(self, role: Segment, index: int, name: str, lanes: int, stats_rows: tuple[int, ...]) -> None:
        object.__setattr__(self, "_wired", False)
        object.__setattr__(self, "process", None)
        self.role = role  # the segment this child runs: DISPATCH or WORKER
        self.index = index
        self.name = name  # the process name, as errors and ``ps`` show it
        self.lanes = lanes  # dispatch process: one per dispatcher; worker: one per worker output
        self.stats_rows = stats_rows  # one statistics row per lane
        self.control: Sender | None = None  # main -> this child
        self.data: tuple[Receiver, ...] = ()  # this child's output k -> main (workers only)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _ENDPOINTS and self._wired:
            raise RuntimeError(f"internal error: {self.name}'s {name} written after the topology was wired")
        if name in ("process", "_wired"):
            raise RuntimeError(f"internal error: {self.name}'s {name} is set by attach/retire and freeze only")
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return f"ChildLink({self.name!r}, lanes={self.lanes}, process={self.process!r})"

    def attach(self, process: Any) -> None:
        """The started process of this link; a link is started once."""
        if self.process is not None:
            raise RuntimeError(f"internal error: {self.name} started twice")
        object.__setattr__(self, "process", process)

    def retire(self, exited: Any) -> None:
        """The reaped process's record (name, pid, exit code) in place of its closed handle."""
        if self.process is None or self.process.exitcode is None:
            raise RuntimeError(f"internal error: {self.name} retired before it was reaped")
        object.__setattr__(self, "process", exited)

    def rewire(self, control: Sender, data: tuple[Receiver, ...]) -> None:
        """A replacement of a dead child (``replacement.py``): new endpoints, and no process
        until the supervisor attaches the new one. The dead one must be reaped."""
        if self.process is not None and self.process.exitcode is None:
            raise RuntimeError(f"internal error: {self.name} rewired while its process runs")
        object.__setattr__(self, "control", control)
        object.__setattr__(self, "data", data)
        object.__setattr__(self, "process", None)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.exitcode is None


class Topology:
    __slots__ = ("dispatch", "workers", "main_row", "stats_rows", "outputs")

    def __init__(self, dispatch: ChildLink | None, workers: tuple[ChildLink, ...], main_row: int, stats_rows: int) -> None:
        self.dispatch = dispatch
        self.workers = workers
        self.main_row = main_row  # the main process's statistics row
        self.stats_rows = stats_rows  # rows in the statistics table
        self.outputs = workers[0].lanes if workers else 0  # worker outputs (branches read by the main segment)

    def __repr__(self) -> str:
        return f"Topology(dispatch={self.dispatch!r}, workers={self.workers!r})"

    def freeze(self) -> None:
        """Every endpoint is in place: from now on the links' endpoints are read-only."""
        for link in self.children():
            object.__setattr__(link, "_wired", True)

    def children(self) -> Iterator[ChildLink]:
        if self.dispatch is not None:
            yield self.dispatch
        yield from self.workers

    def started(self) -> list[ChildLink]:
        return [link for link in self.children() if link.process is not None]

    def receivers_of(self, branch: int) -> list[Receiver]:
        """Worker output ``branch`` of every worker, in worker order."""
        return [link.data[branch] for link in self.workers]

    def data_receivers(self) -> list[tuple[ChildLink, Receiver]]:
        return [(link, receiver) for link in self.workers for receiver in link.data]


def plan_topology(plan: Plan, num_workers: int) -> Topology:
    """The children ``plan`` needs with ``num_workers`` workers, and their statistics rows:
    the dispatch lanes first, then each worker's lanes, then the main process."""
    row = 0

    def rows(count: int) -> tuple[int, ...]:
        nonlocal row
        taken = tuple(range(row, row + count))
        row += count
        return taken

    dispatch = None
    if plan.dispatchers:
        lanes = len(plan.dispatchers)
        dispatch = ChildLink(Segment.DISPATCH, 0, "mprs_plus dispatch process", lanes, rows(lanes))
    outputs = len(plan.worker_outputs)
    workers = tuple(
        ChildLink(Segment.WORKER, w, f"mprs_plus worker {w}", outputs, rows(outputs)) for w in range(num_workers)
    )
    main_row = rows(1)[0]
    return Topology(dispatch, workers, main_row, row)
