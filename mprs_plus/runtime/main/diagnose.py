"""Find what in a segment cannot be pickled, so a spawn/forkserver start can say so.

Under ``spawn`` and ``forkserver`` each child receives its segment pickled; a lambda,
a local function or an open file somewhere inside makes the start fail with an error
that rarely says where. This walks the objects the way pickle would and names the
first attribute path that fails on its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ...graph import MAX_DEPTH, NoGraph, container_items, render_path, state_items
from .. import segments

# Objects nest inside containers: a little deeper than the graph walk's container limit.
_MAX_DEPTH = MAX_DEPTH + 4


def find_unpicklable(obj: Any, name: str = "segment") -> tuple[str, Any, Exception] | None:
    """The deepest attribute path whose value fails to pickle, or None if all pickle."""
    seen: set[int] = set()
    return _search(obj, name, seen, 0)


def _search(obj: Any, path: str, seen: set[int], depth: int) -> tuple[str, Any, Exception] | None:
    if id(obj) in seen or depth > _MAX_DEPTH:
        return None
    seen.add(id(obj))
    try:
        segments.dumps_segment(obj)  # as the segment itself is sent: pickle, then dill if installed
        return None
    except Exception as exc:
        failure = (path, obj, exc)
    for child_path, child in _children(obj, path):
        found = _search(child, child_path, seen, depth + 1)
        if found is not None:
            return found
    return failure


def _children(obj: Any, path: str) -> Iterator[tuple[str, Any]]:
    """What pickle would descend into, read the way the graph walk reads it (graph.py)."""
    if isinstance(obj, NoGraph):
        yield f"{path}.target", obj.target
        return
    members = container_items(obj)
    if members or isinstance(obj, (list, tuple, set, frozenset, Mapping)):
        for step, value in members:
            yield path + render_path((step,)), value
        return
    # Name attributes after their owner's class: "MapperIterDataPipe.fn" says more to a
    # user than the path from the top of the segment.
    for step, value in state_items(obj):
        yield f"{type(obj).__name__}.{render_path((step,))}", value


def unpicklable_error(setup: Any, method: str, process_name: str) -> TypeError:
    found = find_unpicklable(setup, type(setup).__name__)
    if found is None:
        return TypeError(f"could not start {process_name} with the {method!r} start method (see the cause above)")
    path, value, exc = found
    # As with torchdata, dill (when installed) carries what pickle cannot, such as lambdas.
    dill_hint = " (or install dill, which then carries them)" if segments._dill() is None else ""
    return TypeError(
        f"{process_name} cannot be started with the {method!r} start method: {path} = {_short(value)} "
        f"cannot be pickled ({type(exc).__name__}: {exc}). Under {method!r} every DataPipe of the segment "
        f"is pickled into the child: use a module-level function instead of a lambda or local function{dill_hint}, "
        "open files and connections inside __iter__ rather than in __init__, or use "
        "multiprocessing_context='fork'."
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
