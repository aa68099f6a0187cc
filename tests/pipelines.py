"""Pipelines and hooks shared by the tests. Module-level so that spawn can pickle them."""

from __future__ import annotations

import functools
import os
from typing import Any

from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.datapipes.iter import IterableWrapper, IterDataPipe

from mprs_plus import NoGraph


def stamp(item: Any, stage: str) -> Any:
    """Record the pid of the process that ran ``stage`` on this item."""
    value, pids = item if isinstance(item, tuple) else (item, {})
    return value, {**pids, stage: os.getpid()}


def fail_on(item: Any, bad: int = 5) -> Any:
    value = item[0] if isinstance(item, tuple) else item
    if value == bad:
        raise ValueError(f"bad sample {value}")
    return item


class NonReplicable(IterDataPipe):
    def __init__(self, dp: Any) -> None:
        self.dp = dp

    def __iter__(self) -> Any:
        return iter(self.dp)

    def is_replicable(self) -> bool:
        return False


class NonReplicableSource(IterDataPipe):
    def __init__(self, items: Any) -> None:
        self.items = items

    def __iter__(self) -> Any:
        return iter(self.items)

    def is_replicable(self) -> bool:
        return False


def seed_pipe(src: Any) -> IterDataPipe:
    """The seed's create_pipe: dispatch -> workers -> main, each stage stamped."""
    pipe = src.map(functools.partial(stamp, stage="pre"))
    pipe = pipe.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    pipe = pipe.map(functools.partial(stamp, stage="worker"))
    pipe = NonReplicable(pipe)
    return pipe.map(functools.partial(stamp, stage="post"))


class Wrapper(IterDataPipe):
    """The seed's wrapper, as written: keeps its source besides the pipeline."""

    def __init__(self, n: int = 8) -> None:
        self.src = IterableWrapper(range(n))
        self.dp = seed_pipe(self.src)

    def __iter__(self) -> Any:
        return iter(self.dp)


class NoGraphWrapper(IterDataPipe):
    def __init__(self, n: int = 8) -> None:
        self.src = NoGraph(IterableWrapper(range(n)))
        self.dp = seed_pipe(self.src)

    def __iter__(self) -> Any:
        return iter(self.dp)


class ParentsWrapper(IterDataPipe):
    """Declares its real input; the extra reference is then not a parent."""

    def __init__(self, n: int = 8) -> None:
        self.src = IterableWrapper(range(n))
        self.dp = seed_pipe(self.src)

    def get_parents(self) -> list[Any]:
        return [self.dp]

    def __iter__(self) -> Any:
        return iter(self.dp)


class ListWrapper(IterDataPipe):
    """Keeps its pipeline inside a list, and a NoGraph'd source inside a dict."""

    def __init__(self, n: int = 8) -> None:
        self.refs = {"src": NoGraph(IterableWrapper(range(n)))}
        self.stages = [seed_pipe(self.refs["src"])]

    def __iter__(self) -> Any:
        return iter(self.stages[0])


class DictSideRefWrapper(IterDataPipe):
    """A straddling side reference hidden inside a dict attribute."""

    def __init__(self, n: int = 8) -> None:
        src = IterableWrapper(range(n))
        self.refs = {"src": src}
        self.dp = seed_pipe(src)

    def __iter__(self) -> Any:
        return iter(self.dp)


class Outer(IterDataPipe):
    """A wrapper of a wrapper."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __iter__(self) -> Any:
        return iter(self.inner)


class MidGraphRef(IterDataPipe):
    """Keeps a reference to a mid-graph node (the worker stage) besides the output."""

    def __init__(self, n: int = 8, hide: bool = True) -> None:
        src = IterableWrapper(range(n))
        pipe = src.map(functools.partial(stamp, stage="pre"))
        pipe = pipe.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
        mid = pipe.map(functools.partial(stamp, stage="worker"))
        self.mid = NoGraph(mid) if hide else mid
        self.dp = NonReplicable(mid).map(functools.partial(stamp, stage="post"))

    def __iter__(self) -> Any:
        return iter(self.dp)


def sharded_pipe(n: int = 8) -> IterDataPipe:
    """No dispatcher: every worker replicates the source, sharding_filter splits it."""
    pipe = IterableWrapper(range(n)).sharding_filter()
    pipe = pipe.map(functools.partial(stamp, stage="worker"))
    return NonReplicable(pipe).map(functools.partial(stamp, stage="post"))


def shuffled_pipe(n: int = 32) -> IterDataPipe:
    """Shuffles in the dispatch process and again in each worker."""
    pipe = IterableWrapper(range(n)).shuffle()
    pipe = pipe.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    return pipe.shuffle(buffer_size=4)


# -- hooks: record how often they ran, in the process that ran them ---------------------

_HOOK_COUNTS = {"init": 0, "reset": 0}


def _with_counts(item: Any) -> Any:
    return item, os.getpid(), _HOOK_COUNTS["init"], _HOOK_COUNTS["reset"]


def counting_init_fn(datapipe: Any, worker_info: Any) -> Any:
    _HOOK_COUNTS["init"] += 1
    return datapipe.map(_with_counts)


def counting_reset_fn(datapipe: Any, worker_info: Any, seed_generator: Any) -> Any:
    _HOOK_COUNTS["reset"] += 1
    return datapipe


fail_on_5 = fail_on


# -- faults --------------------------------------------------------------------------------


def exit_on(item: Any, bad: int = 5, code: int = 3) -> Any:
    """Leave the process abruptly, as a crash in native code would."""
    if item == bad:
        os._exit(code)
    return item


def kill_self_on(item: Any, bad: int = 5) -> Any:
    """SIGKILL this process, as the out-of-memory killer would."""
    import signal

    if item == bad:
        os.kill(os.getpid(), signal.SIGKILL)
    return item


def block_on(item: Any, bad: int = 3) -> Any:
    """Never return for one item: a stuck read."""
    import threading

    if item == bad:
        threading.Event().wait()
    return item


class UnpicklableError(Exception):
    """Cannot travel between processes: it holds a lock."""

    def __init__(self, message: str) -> None:
        import threading

        super().__init__(message)
        self.lock = threading.Lock()


def raise_unpicklable(item: Any) -> Any:
    if item == 2:
        raise UnpicklableError(f"unpicklable failure at {item}")
    return item


class NeedsTwoArgsError(Exception):
    """Pickles, but cannot be rebuilt: its constructor wants two arguments."""

    def __init__(self, what: str, where: int) -> None:
        super().__init__(f"{what} at {where}")


def raise_needs_two(item: Any) -> Any:
    if item == 2:
        raise NeedsTwoArgsError("odd failure", item)
    return item


def pid_of(item: Any) -> Any:
    return item, os.getpid()


def broken_init_fn(datapipe: Any, worker_info: Any) -> Any:
    raise RuntimeError(f"init failed in worker {worker_info.worker_id}")
