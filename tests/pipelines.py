"""Pipelines and hooks shared by the tests. Module-level so that spawn can pickle them."""

from __future__ import annotations

import functools
import os
import queue
import threading
from typing import Any

from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.datapipes.iter import IterableWrapper, IterDataPipe

from mprs_plus import NoGraph
from mprs_plus._cli.demo import NonReplicable, stamp  # the demo's own stages, shared  # noqa: F401

# Where a behaviour does not depend on how a child began, beyond inheriting its segment or
# receiving it pickled, tests run under these two: forkserver pickles as spawn does, and
# its children start sooner. Every start method runs in test_reading_service.py and
# test_matrix.py.
INHERITED_AND_PICKLED = ("fork", "forkserver")


def fail_on(item: Any, bad: int = 5) -> Any:
    value = item[0] if isinstance(item, tuple) else item
    if value == bad:
        raise ValueError(f"bad sample {value}")
    return item


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


# -- pause, resume, limit: hooks that count in the process that ran them ---------------------

COUNTS: dict[str, int] = {}


def _bump(name: str) -> None:
    COUNTS[name] = COUNTS.get(name, 0) + 1


class PauseAware(IterDataPipe):
    """Counts the pause() / resume() calls it gets, in the process that runs it."""

    def __init__(self, dp: Any, label: str, replicable: bool = True) -> None:
        self.dp = dp
        self.label = label
        self.replicable = replicable

    def __iter__(self) -> Any:
        return iter(self.dp)

    def is_replicable(self) -> bool:
        return self.replicable

    def pause(self) -> None:
        _bump(f"{self.label}.pause")

    def resume(self) -> None:
        _bump(f"{self.label}.resume")


def with_process_counts(item: Any, label: str) -> Any:
    """Attach this process's counts, under ``label``, to the item."""
    value, counts = item if isinstance(item, tuple) else (item, {})
    return value, {**counts, label: dict(COUNTS)}


def pause_fn(datapipe: Any) -> Any:
    _bump("pause_fn")
    return datapipe


def resume_fn(datapipe: Any) -> Any:
    _bump("resume_fn")
    return datapipe


def limit_fn(datapipe: Any, num_batches: Any) -> Any:
    _bump(f"limit_fn({num_batches})")
    return datapipe


def pause_aware_pipe(n: int, dispatch: bool) -> IterDataPipe:
    """A PauseAware DataPipe in every segment; items carry the counts of the processes that
    made them: ("dispatch", "worker")."""
    pipe = IterableWrapper(range(n))
    if dispatch:
        pipe = PauseAware(pipe, "dispatch").map(functools.partial(with_process_counts, label="dispatch"))
        pipe = pipe.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    else:
        pipe = pipe.sharding_filter()
    pipe = PauseAware(pipe, "worker").map(functools.partial(with_process_counts, label="worker"))
    return PauseAware(pipe, "main", replicable=False)


# -- several branches --------------------------------------------------------------------------


class JoinInMain(IterDataPipe):
    """A non-replicable zip: its inputs are separate worker outputs."""

    def __init__(self, *dps: Any) -> None:
        self.dps = list(dps)

    def __iter__(self) -> Any:
        return zip(*self.dps)

    def is_replicable(self) -> bool:
        return False


class ThreadedJoin(IterDataPipe):
    """A non-replicable zip that reads its first input in a thread of its own, while the
    calling thread reads the second: two threads of the main process reading worker
    outputs at once."""

    def __init__(self, left: Any, right: Any) -> None:
        self.left, self.right = left, right

    def __iter__(self) -> Any:
        lefts: queue.Queue[Any] = queue.Queue()

        def read_left() -> None:
            try:
                for item in self.left:
                    lefts.put(("item", item))
            except BaseException as exc:  # handed to the calling thread
                lefts.put(("error", exc))
            lefts.put(("end", None))

        reader = threading.Thread(target=read_left, daemon=True)
        reader.start()
        for right in self.right:
            kind, left = lefts.get(timeout=30)
            if kind == "error":
                raise left
            assert kind == "item", "the left input ended first"
            yield left, right
        assert lefts.get(timeout=30)[0] == "end", "the left input has items left"
        reader.join(30)

    def is_replicable(self) -> bool:
        return False


def tag(item: Any, label: str) -> Any:
    return label, item, os.getpid()


def big(item: Any, size: int = 200_000) -> Any:
    """An item large enough to fill a channel on its own."""
    return item, bytes(size)


def value_of(item: Any) -> Any:
    return item[0] if isinstance(item, tuple) else item


def double(x: Any) -> Any:
    return 2 * x


def first_and_size(pair: Any) -> Any:
    """(small, (value, payload)) -> (small, value, len(payload)): keeps the main process light."""
    small, (value, payload) = pair
    return small, value, len(payload)


def branch_pipes(n: int = 10) -> IterDataPipe:
    """Two sharded branches joined by a non-replicable zip: two worker outputs."""
    left = IterableWrapper(range(n)).sharding_filter().map(functools.partial(tag, label="a"))
    right = IterableWrapper(range(100, 100 + n)).sharding_filter().map(functools.partial(tag, label="b"))
    return JoinInMain(left, right)


def two_dispatchers(n: int = 10) -> IterDataPipe:
    """Two dispatchers feeding one worker segment (zipped there)."""
    first = IterableWrapper(range(n)).map(functools.partial(stamp, stage="pre"))
    first = first.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    second = IterableWrapper(range(100, 100 + n)).sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    return NonReplicable(first.zip(second).map(functools.partial(tag, label="w")))


def shared_in_workers(n: int = 10) -> IterDataPipe:
    """Two worker outputs that share their upstream (a fork inside the worker segment)."""
    left, right = IterableWrapper(range(n)).sharding_filter().fork(2)
    return JoinInMain(left.map(functools.partial(tag, label="a")), right.map(double))


def shared_in_dispatch(n: int = 10) -> IterDataPipe:
    """Two dispatchers that share their upstream (a fork in the dispatch process), each
    read by its own worker output."""
    left, right = IterableWrapper(range(n)).fork(2)
    left = left.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    right = right.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    return JoinInMain(left.map(functools.partial(tag, label="a")), right.map(double))


def map_outputs(datapipe: Any, worker_info: Any) -> Any:
    """A worker_init_fn for a segment with several outputs."""
    datapipe.outputs = [output.map(functools.partial(tag, label=f"init{worker_info.worker_id}")) for output in datapipe.outputs]
    return datapipe


def wrong_init(datapipe: Any, worker_info: Any) -> Any:
    return datapipe.outputs[0]


# -- order modes, hooks of the dispatch process, the test matrix ------------------------------


HELD: dict = {}  # item -> multiprocessing Event, inherited by forked workers


def held_until_set(item: Any) -> Any:
    """An item named in ``HELD`` waits (at most a minute) for its Event: its worker is held
    while it computes, outside any channel wait, until the main process sets it (fork only)."""
    event = HELD.get(item)
    if event is not None:
        event.wait(60)
    return item


def dispatch_init(datapipe: Any, worker_info: Any) -> Any:
    _bump("dispatch_init")
    info = (worker_info.num_workers, worker_info.worker_id)
    return datapipe.map(functools.partial(_mark_dispatch, info=info))


def _mark_dispatch(item: Any, info: Any) -> Any:
    return item, os.getpid(), COUNTS.get("dispatch_init", 0), info


def matrix_pipe(n: int, dispatch: bool) -> IterDataPipe:
    """Random in every segment: a shared-seed shuffle before the split, a per-worker one after."""
    pipe = IterableWrapper(range(n)).shuffle()
    if dispatch:
        pipe = pipe.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    else:
        pipe = pipe.sharding_filter()
    return pipe.shuffle(buffer_size=4).map(double)


def plain_pipe(items: Any, dispatch: bool) -> IterDataPipe:
    pipe = IterableWrapper(list(items))
    if dispatch:
        return pipe.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING).map(double)
    return pipe.sharding_filter().map(double)


def identity(item: Any) -> Any:
    return item


def mixed_pipe(n: int = 8) -> IterDataPipe:
    """Two worker outputs joined in the main process: one fed by two dispatchers that share
    their source, one sharded in the workers."""
    first, second = IterableWrapper(range(n)).fork(2)
    first = first.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    second = second.map(double).sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    dealt = first.zip(second).map(functools.partial(tag, label="dealt"))
    sharded = IterableWrapper(range(100, 100 + n)).sharding_filter()
    return JoinInMain(dealt, sharded)


def unpicklable(item: Any) -> Any:
    """An item that cannot travel between processes (a generator)."""
    return (x for x in [item])


def unpicklable_at_5(item: Any) -> Any:
    """Item 5 cannot travel between processes; the others can."""
    return (x for x in [item]) if item == 5 else item


# -- statistics ----------------------------------------------------------------------------


def spin(item: Any, seconds: float = 0.002) -> Any:
    """Burn CPU for ``seconds``: work that only more processes can speed up."""
    import time

    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
    return item


def kilobytes(item: Any) -> Any:
    return bytes(1024 * 64)


# -- stop ----------------------------------------------------------------------------------


class _RebuiltOutsideMain:
    """Pickles anywhere, unpickles anywhere but in the process ``main_pid``."""

    def __init__(self, value: Any, main_pid: int) -> None:
        self.value = value
        self.main_pid = main_pid

    def __reduce__(self) -> Any:
        return (_rebuild_outside_main, (self.value, self.main_pid))


class RebuildError(Exception):
    pass


def _rebuild_outside_main(value: Any, main_pid: int) -> Any:
    if os.getpid() == main_pid:
        raise RebuildError(f"item {value} cannot be rebuilt in the main process")
    return value


def unloadable_in_main(item: Any, main_pid: int, first_bad: int = 5) -> Any:
    """Items from ``first_bad`` on fail to unpickle in the main process ``main_pid``."""
    return _RebuiltOutsideMain(item, main_pid) if item >= first_bad else item


# -- NoGraph references and aliased tensors ---------------------------------------------------


class ReadsItsSource(IterDataPipe):
    """Runs in the main process (not replicable) and reads attributes of a DataPipe of
    another segment through ``NoGraph``: the reason most users keep such a reference."""

    def __init__(self, dp: Any, source: Any, attribute: str) -> None:
        self.dp = dp
        self.source = NoGraph(source)
        self.attribute = attribute

    def __iter__(self) -> Any:
        value = getattr(self.source, self.attribute)
        label = getattr(value, "__name__", value)
        for item in self.dp:
            yield item, type(self.source.target).__name__, label

    def is_replicable(self) -> bool:
        return False


def worker_target_pipe(n: int = 6) -> IterDataPipe:
    """The NoGraph target is the worker segment's output, a ``map``: its ``fn`` is read."""
    mid = IterableWrapper(range(n)).sharding_filter().map(double)
    return ReadsItsSource(mid, mid, "fn")


def dispatch_target_pipe(n: int = 6) -> IterDataPipe:
    """The NoGraph target is the dispatch segment's source: its ``iterable`` is read."""
    source = IterableWrapper(list(range(n)))
    dispatched = source.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING).map(double)
    return ReadsItsSource(dispatched, source, "iterable")


def tensor_and_views(item: Any) -> Any:
    """An item whose tensors share one storage, as a model input and its reshapes do."""
    import torch

    base = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * item
    return {"base": base, "transposed": base.t(), "flat": base.view(-1), "row": base[1]}


def filled_tensor(index: int, numel: int = 64 << 10) -> Any:
    """A float32 tensor of ``numel`` elements (256 KiB by default), every one ``index``."""
    import torch

    return torch.full((numel,), float(index))


class Ballast:
    """An ``iter_reset_fn`` that changes nothing but pickles to ``size`` bytes: a Reset too
    large to wait in a control channel before its child has started."""

    def __init__(self, size: int) -> None:
        self.ballast = bytes(size)

    def __call__(self, datapipe: Any) -> Any:
        return datapipe


def is_even(item: Any) -> bool:
    return item % 2 == 0


def starving_pipe(n: int) -> IterDataPipe:
    """Dispatched round-robin to two workers, then filtered: worker 1 receives only odd
    items and keeps none, so an in-order read waits for it while worker 0's items pile up.

    The cycle closes only if worker 0's share does not fit in what its path buffers, and
    batching makes that a matter of timing: channels count messages, and a worker that
    finds several inputs waiting (a loaded machine) sends up to 64 items in one. At the
    default options 15 messages to the main process and 10 from the dispatcher hold over
    a thousand small items, so a share of 1,000 once ran through: pass 20,000 or so."""
    return (
        IterableWrapper(range(n)).sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING).filter(is_even)
    )



class SharedListReader(IterDataPipe):
    """Reads its share of a ``SharedList`` and says, with each item, whether this process
    maps the shared block (True) or holds a copy of its bytes (False)."""

    def __init__(self, records: Any) -> None:
        self.records = records

    def __iter__(self):
        mapped = self.records._block.fd is not None
        for item in self.records:
            yield item, mapped, os.getpid()
