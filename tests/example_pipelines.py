"""Pipelines for the CLI and rendering tests, importable by path or as a module.

Small versions of the seed's graphs: each factory returns a DataPipe and runs nothing.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.datapipes.iter import IterableWrapper, IterDataPipe

from mprs_plus import NoGraph
from mprs_plus._cli.demo import NonReplicable


def double(x: int) -> int:
    return 2 * x


def tagged(x: Any, tag: str = "") -> Any:
    return x


def _three_stages(src: Any) -> IterDataPipe:
    pipe = src.map(double).sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    return NonReplicable(pipe.map(double)).map(double)


class Wrapper(IterDataPipe):
    """The seed's wrapper: it keeps its source besides the pipeline built on it."""

    def __init__(self, hide_source: bool) -> None:
        src = IterableWrapper(range(4))
        self.src = NoGraph(src) if hide_source else src
        self.dp = _three_stages(src)

    def __iter__(self) -> Any:
        return iter(self.dp)


def three_stages() -> IterDataPipe:
    return _three_stages(IterableWrapper(range(4)))


def wrapper_fixed() -> IterDataPipe:
    return Wrapper(hide_source=True)


def wrapper_ambiguous() -> IterDataPipe:
    return Wrapper(hide_source=False)


def unsharded() -> IterDataPipe:
    return IterableWrapper(range(4)).map(double)


def two_worker_branches() -> IterDataPipe:
    left = IterableWrapper(range(4)).sharding_filter()
    right = IterableWrapper(range(4)).sharding_filter()
    return NonReplicable(left).zip(NonReplicable(right))


def not_a_datapipe() -> int:
    return 4


def broken() -> IterDataPipe:
    raise RuntimeError("the factory itself fails")


ready_made = IterableWrapper(range(3)).sharding_filter()
