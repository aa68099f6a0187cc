"""Discover the DataPipe graph from explicit markers.

Rule 1: a DataPipe that defines ``get_parents()`` has exactly those parents. Any other
DataPipe's parents are the DataPipes reachable through its attributes, also inside
lists, tuples, dicts and sets (as torch does), except values wrapped in ``NoGraph``.

Rule 2: ``NoGraph(dp)`` is a transparent proxy. Attribute access and iteration reach
``dp``; graph discovery (this module *and* torch's ``traverse_dps``) does not see it,
because it is neither a DataPipe nor a collection; it pickles and deep-copies with its
target.

    output  <- parent <- ... <- source        discover(output) -> Graph
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch.utils.data import IterDataPipe, MapDataPipe

DataPipe = IterDataPipe | MapDataPipe


class NoGraph:
    """Hide a reference from graph discovery while keeping it fully usable.

    Use it for a DataPipe that an object keeps *besides* its real input, so that the
    planner does not treat it as a second parent::

        class Wrapper(IterDataPipe):
            def __init__(self):
                self.src = NoGraph(IterableWrapper(range(4)))
                self.dp = self.src.map(fn)          # reaches the real source
            def __iter__(self):
                return iter(self.dp)
    """

    __slots__ = ("_target",)

    def __init__(self, target: Any) -> None:
        object.__setattr__(self, "_target", target)

    @property
    def target(self) -> Any:
        """The wrapped object."""
        return object.__getattribute__(self, "_target")

    def __getattr__(self, name: str) -> Any:
        try:
            target = object.__getattribute__(self, "_target")
        except AttributeError:  # during unpickling, before __init__ ran
            raise AttributeError(name) from None
        return getattr(target, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.target, name, value)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.target)

    def __len__(self) -> int:
        return len(self.target)

    def __getitem__(self, index: Any) -> Any:
        return self.target[index]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.target(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (NoGraph, (self.target,))

    def __repr__(self) -> str:
        return f"NoGraph({self.target!r})"


@dataclass(frozen=True)
class Edge:
    """A reference from a node to one of its parents, with the path it was found at."""

    parent: int
    path: str  # e.g. "src", "refs['a']", "items[0]", "get_parents()[1]"


@dataclass(frozen=True)
class Node:
    index: int
    name: str  # class name, for messages and renderings
    edges: tuple[Edge, ...]
    declared: bool  # parents came from get_parents()

    @property
    def parents(self) -> tuple[int, ...]:
        """Parent indices in discovery order, without repeats."""
        return tuple(dict.fromkeys(edge.parent for edge in self.edges))


@dataclass(frozen=True)
class Graph:
    """Nodes indexed from 0 (the output); ``datapipes[i]`` is the object of node i."""

    nodes: tuple[Node, ...]
    datapipes: tuple[Any, ...]

    @property
    def output(self) -> int:
        return 0

    def children(self) -> dict[int, tuple[int, ...]]:
        result: dict[int, list[int]] = {node.index: [] for node in self.nodes}
        for node in self.nodes:
            for parent in node.parents:
                result[parent].append(node.index)
        return {index: tuple(kids) for index, kids in result.items()}

    def ancestors(self, index: int) -> set[int]:
        """Every node upstream of ``index`` (not including it)."""
        seen: set[int] = set()
        stack = list(self.nodes[index].parents)
        while stack:
            current = stack.pop()
            if current not in seen:
                seen.add(current)
                stack.extend(self.nodes[current].parents)
        return seen

    def topological(self) -> list[int]:
        """Sources first, the output last."""
        order: list[int] = []
        state: dict[int, bool] = {}
        for root in range(len(self.nodes)):
            stack: list[tuple[int, bool]] = [(root, False)]
            while stack:
                index, done = stack.pop()
                if done:
                    order.append(index)
                    state[index] = True
                    continue
                if index in state:
                    continue
                state[index] = False
                stack.append((index, True))
                stack.extend((parent, False) for parent in self.nodes[index].parents if parent not in state)
        return order


def is_datapipe(obj: Any) -> bool:
    return isinstance(obj, (IterDataPipe, MapDataPipe))


def discover(datapipe: Any) -> Graph:
    """Walk from ``datapipe`` to its sources following rule 1. Pure: nothing is iterated."""
    if not is_datapipe(datapipe):
        raise TypeError(f"expected an IterDataPipe or MapDataPipe, got {type(datapipe).__name__}")
    index_of: dict[int, int] = {id(datapipe): 0}
    datapipes: list[Any] = [datapipe]
    raw_edges: list[list[tuple[Any, str]]] = []
    declared: list[bool] = []
    position = 0
    while position < len(datapipes):
        current = datapipes[position]
        refs, from_method = _parent_refs(current)
        raw_edges.append(refs)
        declared.append(from_method)
        for parent, _ in refs:
            if id(parent) not in index_of:
                index_of[id(parent)] = len(datapipes)
                datapipes.append(parent)
        position += 1
    nodes = tuple(
        Node(
            index=i,
            name=type(dp).__name__,
            edges=tuple(Edge(index_of[id(parent)], path) for parent, path in raw_edges[i]),
            declared=declared[i],
        )
        for i, dp in enumerate(datapipes)
    )
    return Graph(nodes=nodes, datapipes=tuple(datapipes))


def _parent_refs(datapipe: Any) -> tuple[list[tuple[Any, str]], bool]:
    get_parents = getattr(type(datapipe), "get_parents", None)
    if callable(get_parents):
        parents = datapipe.get_parents()
        refs = []
        for i, parent in enumerate(parents):
            parent = parent.target if isinstance(parent, NoGraph) else parent
            if not is_datapipe(parent):
                raise TypeError(
                    f"{type(datapipe).__name__}.get_parents() returned {type(parent).__name__} at "
                    f"position {i}: it must return DataPipes only"
                )
            refs.append((parent, f"get_parents()[{i}]"))
        return refs, True
    refs = []
    for name, value in _state_items(datapipe):
        _collect(value, name, refs, depth=0)
    return refs, False


def _state_items(datapipe: Any) -> list[tuple[str, Any]]:
    """The attributes torch would pickle: ``__getstate__`` when it gives a dict or tuple."""
    try:
        state = datapipe.__getstate__()
    except Exception:  # a custom __getstate__ that refuses: fall back to the instance dict
        state = None
    if isinstance(state, Mapping):
        return [(str(k), v) for k, v in state.items()]
    if isinstance(state, (tuple, list)):
        return [(f"__getstate__()[{i}]", v) for i, v in enumerate(state)]
    return list(getattr(datapipe, "__dict__", {}).items())


_MAX_DEPTH = 8  # nested containers deeper than this are data, not graph structure


def _collect(value: Any, path: str, refs: list[tuple[Any, str]], depth: int) -> None:
    if isinstance(value, NoGraph):
        return
    if is_datapipe(value):
        refs.append((value, path))
        return
    if depth >= _MAX_DEPTH:
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _collect(item, f"{path}[{i}]", refs, depth + 1)
    elif isinstance(value, Mapping):
        for key, item in list(value.items()):
            _collect(item, f"{path}[{key!r}]", refs, depth + 1)
    elif isinstance(value, (set, frozenset)):
        for item in value:
            _collect(item, f"{path}{{...}}", refs, depth + 1)
