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

import functools
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

from torch.utils.data import IterDataPipe, MapDataPipe

DataPipe = IterDataPipe | MapDataPipe


class NoGraph:
    """Hide a reference from graph discovery while keeping it fully usable.

    Use it for a DataPipe that an object keeps *besides* its real input, so that the
    planner does not treat it as a second parent:

    ```python
    class Wrapper(IterDataPipe):
        def __init__(self):
            self.src = NoGraph(IterableWrapper(range(4)))
            self.dp = self.src.map(fn)          # reaches the real source
        def __iter__(self):
            return iter(self.dp)
    ```

    Args:
        target: the object to hide; attribute reads, calls and iteration reach it.
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


Step = tuple[str, Any]
"""One step of a reference path: ``("attr", name)`` (an attribute, or a key of the state
``__getstate__`` returns), ``("state", i)`` (a position of a tuple state), ``("item", key)``
(a list or tuple index, a dict key), ``("member", None)`` (inside a set), or
``("parents", i)`` (position in ``get_parents()``)."""


# Edge, Node and Graph are named tuples, not dataclasses: as immutable, with the same repr,
# but made without generating code at import, which every loader's first item waits for.
class Edge(NamedTuple):
    """A reference from a node to one of its parents, with the path it was found at."""

    parent: int
    path: str  # e.g. "src", "refs['a']", "items[0]", "get_parents()[1]"
    steps: tuple[Step, ...] = ()  # the same path, replayable by ``replace_reference``


class Node(NamedTuple):
    index: int
    name: str  # class name, for messages and renderings
    edges: tuple[Edge, ...]
    declared: bool  # parents came from get_parents()

    @property
    def parents(self) -> tuple[int, ...]:
        """Parent indices in discovery order, without repeats."""
        return tuple(dict.fromkeys(edge.parent for edge in self.edges))


class Graph(NamedTuple):
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
    # A look at the class's MRO rather than isinstance: the DataPipe classes are ABCs, and
    # an ABC answers its first "no" for each other type by walking every subclass torch and
    # torchdata define (over a thousand): a process's first plan waited for that walk
    # (figures in docs/benchmarks-history.md, Cold start).
    # DataPipes subclass these two; none is registered as a virtual subclass.
    mro = type(obj).__mro__
    return IterDataPipe in mro or MapDataPipe in mro


def _is_mapping(value: Any) -> bool:
    """``isinstance(value, Mapping)``, with the ABC's walk only for a type that could be
    one: a dict, or a class with ``keys`` (every mapping has it)."""
    return isinstance(value, dict) or (hasattr(type(value), "keys") and isinstance(value, Mapping))


def discover(datapipe: Any) -> Graph:
    """Walk from ``datapipe`` to its sources following rule 1. Pure: nothing is iterated.

    The one walk of the graph: planning, segment building (which replays the recorded
    edge paths) and diagnosis all read references through this module. A DataPipe that
    refers to itself (``self.me = self``) is not its own parent, as torch ignores it too.
    """
    if not is_datapipe(datapipe):
        raise TypeError(f"expected an IterDataPipe or MapDataPipe, got {type(datapipe).__name__}")
    index_of: dict[int, int] = {id(datapipe): 0}
    datapipes: list[Any] = [datapipe]
    raw_edges: list[list[tuple[Any, tuple[Step, ...]]]] = []
    declared: list[bool] = []
    position = 0
    while position < len(datapipes):
        current = datapipes[position]
        refs, from_method = parent_references(current)
        refs = [(parent, steps) for parent, steps in refs if parent is not current]
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
            edges=tuple(Edge(index_of[id(parent)], render_path(steps), steps) for parent, steps in raw_edges[i]),
            declared=declared[i],
        )
        for i, dp in enumerate(datapipes)
    )
    return Graph(nodes=nodes, datapipes=tuple(datapipes))


def parent_references(datapipe: Any) -> tuple[list[tuple[Any, tuple[Step, ...]]], bool]:
    """The parents of one DataPipe with the path of each reference, and whether they were
    declared by ``get_parents()``."""
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
            refs.append((parent, (("parents", i),)))
        return refs, True
    return list(datapipe_references(state_items(datapipe))), False


def state_items(obj: Any) -> list[tuple[Step, Any]]:
    """The attributes torch would pickle: ``__getstate__`` when it gives a dict or tuple,
    else the instance dict."""
    try:
        state = obj.__getstate__()
    except Exception:  # a custom __getstate__ that refuses: fall back to the instance dict
        state = None
    if _is_mapping(state):
        return [(("attr", str(k)), v) for k, v in state.items()]
    if isinstance(state, (tuple, list)):
        return [(("state", i), v) for i, v in enumerate(state)]
    return [(("attr", k), v) for k, v in getattr(obj, "__dict__", {}).items()]


def container_items(value: Any) -> list[tuple[Step, Any]]:
    """The members of a list, tuple, dict or set with their steps; nothing for anything else."""
    if isinstance(value, (list, tuple)):
        return [(("item", i), item) for i, item in enumerate(value)]
    if _is_mapping(value):
        return [(("item", key), item) for key, item in list(value.items())]
    if isinstance(value, (set, frozenset)):
        return [(("member", None), item) for item in value]
    return []


MAX_DEPTH = 8  # nested containers deeper than this are data, not graph structure


def datapipe_references(items: list[tuple[Step, Any]]) -> Iterator[tuple[Any, tuple[Step, ...]]]:
    """Every DataPipe inside ``items`` (and their containers), with its path; NoGraph hides."""
    stack = [((step,), value, 0) for step, value in reversed(items)]
    while stack:
        steps, value, depth = stack.pop()
        if isinstance(value, NoGraph):
            continue
        if is_datapipe(value):
            yield value, steps
            continue
        if depth >= MAX_DEPTH or isinstance(value, (str, bytes)):
            continue
        stack.extend((steps + (step,), item, depth + 1) for step, item in reversed(container_items(value)))


def render_path(steps: tuple[Step, ...]) -> str:
    """``("attr", "refs"), ("item", "a")`` -> ``refs['a']``: how messages name a reference."""
    text = ""
    for kind, key in steps:
        if kind == "attr":
            text += key if not text else f".{key}"
        elif kind == "state":
            text += f"__getstate__()[{key}]"
        elif kind == "parents":
            text += f"get_parents()[{key}]"
        elif kind == "member":
            text += "{...}"
        else:
            text += f"[{key!r}]"
    return text


def replace_reference(owner: Any, steps: tuple[Step, ...], old: Any, new: Any) -> bool:
    """Make ``owner`` refer to ``new`` where ``steps`` (a path ``discover`` recorded) found
    ``old``: lists, dicts and sets change in place, tuples are rebuilt up to the attribute.

    Paths that cannot be replayed on the instance (a declared parent, a custom tuple
    state) are looked up by identity among the instance's attributes, through the same
    walk. Returns False when ``old`` is held nowhere it can be replaced. Never enters a
    ``NoGraph``: what it points to stays as the user set it.
    """
    state = getattr(owner, "__dict__", None)
    if not isinstance(state, dict):
        return False
    paths = [steps] if steps and steps[0][0] == "attr" and _resolve(state, steps) is old else []
    if not paths:
        attrs = [(("attr", k), v) for k, v in state.items()]
        paths = [found for value, found in datapipe_references(attrs) if value is old]
    for path in paths:
        name = path[0][1]
        state[name] = _replaced(state[name], path[1:], old, new)
    return bool(paths)


_MISSING = object()


def _resolve(state: dict[str, Any], steps: tuple[Step, ...]) -> Any:
    value: Any = state.get(steps[0][1], _MISSING)
    for kind, key in steps[1:]:
        if kind != "item":
            return _MISSING
        try:
            value = value[key]
        except Exception:
            return _MISSING
    return value


def _replaced(value: Any, steps: tuple[Step, ...], old: Any, new: Any) -> Any:
    if not steps:
        return new if value is old else value
    (kind, key), rest = steps[0], steps[1:]
    if kind == "member":
        members = [_replaced(item, rest, old, new) if _holds(item, rest, old) else item for item in value]
        if isinstance(value, set):
            value.clear()
            value.update(members)
            return value
        return type(value)(members)
    if isinstance(value, tuple):
        items = list(value)
        items[key] = _replaced(items[key], rest, old, new)
        return value._make(items) if hasattr(value, "_make") else type(value)(items)
    value[key] = _replaced(value[key], rest, old, new)
    return value


def _holds(value: Any, steps: tuple[Step, ...], old: Any) -> bool:
    if not steps:
        return value is old
    return any(_holds(item, steps[1:], old) for step, item in container_items(value))


def describe(datapipe: Any) -> str:
    """A short label: the class name, plus the function of a map/filter-like DataPipe."""
    name = type(datapipe).__name__
    fn = getattr(datapipe, "fn", None) or getattr(datapipe, "filter_fn", None)
    if fn is None:
        return name
    return f"{name}({_callable_name(fn)})"


def _callable_name(fn: Any) -> str:
    if isinstance(fn, functools.partial):
        inner = _callable_name(fn.func)
        shown = [repr(a) for a in fn.args] + [f"{k}={v!r}" for k, v in fn.keywords.items()]
        return f"{inner}[{', '.join(shown)}]" if shown else inner
    return getattr(fn, "__qualname__", None) or type(fn).__name__
