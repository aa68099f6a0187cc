"""The worker process: runs one replica of the worker segment and streams its outputs.

    dispatcher d --channel (d, w)--> ChannelMux --> DispatchedInput d --+
                                                                        v
                                  worker segment --> output k --> lane k --channel (w, k)--> main

One lane per worker output (branch), each the only writer of its channel to the main
process; a worker segment with one output runs its single lane in the process's main
thread, as torchdata's workers do. The lanes and the control messages are described in
``lanes.py``, ``loop.py`` and ``control.py``.

A worker never rediscovers the graph: it receives its segment ready to run, with
``DispatchedInput`` placeholders where the dispatch process feeds it. All its dispatched
inputs are read through one ``ChannelMux``, so stale items of an abandoned epoch are
dropped from every input whenever one of them would block, and a dispatcher blocked on
them moves on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch.utils.data.graph_settings
from torch.utils.data import IterDataPipe
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES

from ...transport import ChannelBroken, EndOfStream, Receiver, Sender, wait_readable
from .control import SegmentControl, make_locks, outputs_of, segment_root
from .loop import ChildLoop
from .lanes import OutputLane, current_lane_stats, flush_current_lane
from .lifecycle import child_setup
from ..data_messages import Kind, describe_process
from ...segment import Segment
from ..mux import CLOSED_EPOCH, ChannelMux, WakePipe
from ..control_messages import Received, Reset
from ..timeline import Span


class DispatchedInput(IterDataPipe):
    """Stands in the worker's copy of the graph where a dispatcher was: yields the items
    that dispatcher hands to this worker for the current epoch."""

    def __init__(self, name: str, position: int = 0) -> None:
        self.name = name
        self.position = position  # index of this input's channel in the worker's mux
        self.mux: ChannelMux | None = None
        self.child: ChildLoop | None = None  # owns the epoch: a stream reads the one it began in

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name, "position": self.position}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["name"], state["position"])  # type: ignore[misc]


def _iterate_dispatched(self: DispatchedInput) -> Iterator[Any]:
    mux, child = self.mux, self.child
    if mux is None or child is None:
        raise RuntimeError(f"internal error: {self.name} iterated outside a worker process")
    take, position, epoch = mux.take, self.position, child.epoch
    stats = current_lane_stats()
    clock = time.perf_counter
    while True:
        # Before blocking, the lane sends what it holds: nobody waits on items stuck in a batch.
        asked = clock()
        message = take(position, epoch, flush_current_lane)
        if stats is not None:
            # Time spent waiting here is counted inside the lane's next(): move it over.
            waited = clock() - asked
            stats.wait_input += waited
            stats.busy -= waited
            if stats.trace is not None:
                stats.trace.span(Span.WAIT_INPUT, asked, asked + waited)
        if message is None:
            return  # a newer epoch began, or the dispatch process stopped
        kind, _, payload = message
        if kind == Kind.ITEMS:
            if stats is not None:
                stats.items_in += len(payload)
            yield from payload
        elif kind == Kind.END:
            return
        else:
            raise payload.rebuild()


# Assigned after the class is made, like the main process's reader: torch's DataPipe
# metaclass would wrap an ``__iter__`` of the class body with per-item bookkeeping.
DispatchedInput.__iter__ = _iterate_dispatched  # type: ignore[method-assign]


# The records below are named tuples, not dataclasses: a dataclass compiles its methods
# when its module loads, which every training script's first loader waits for.
class WorkerProgram(NamedTuple):
    """What a worker runs: its copy of the segment, built once in the main process."""

    outputs: tuple[Any, ...]  # one per worker output (lane)
    inputs: tuple[DispatchedInput, ...]  # one per dispatcher, in the plan's order
    sharding_roots: tuple[Any, ...]
    groups: tuple[int, ...] = (0,)  # outputs with the same group share DataPipes (and a lock)


class WorkerSetup(NamedTuple):
    """Everything a worker process starts from: one argument of its process."""

    worker_id: int
    num_workers: int
    program: WorkerProgram
    control: Receiver  # main -> this worker
    data: tuple[Sender, ...]  # this worker -> main, one per output
    inputs: tuple[Receiver, ...]  # dispatch -> this worker, one per DispatchedInput
    init_fn: Callable[..., Any] | None
    reset_fn: Callable[..., Any] | None
    stats: tuple[Any, ...] = ()  # a StatsWriter per output lane, when statistics are collected
    liveness: tuple[Any, ...] = ()  # a LaneLiveness per output lane (liveness.py)
    windows: tuple[Any, ...] = ()  # an ItemWindow per output lane, when the front end asks for one (window.py)
    record: Any = None  # a GeneratorRecord when dead workers are replaced (generators.py)
    batch_items: int = 64  # at most this many small items per message (a backend may say more)


def worker_main(setup: WorkerSetup) -> None:
    child_setup([setup.control, *setup.data, *setup.inputs])
    where = describe_process(Segment.WORKER, setup.worker_id)
    program = setup.program
    mux = _input_mux(setup.inputs, [placeholder.name for placeholder in program.inputs])
    for placeholder in program.inputs:
        placeholder.mux = mux
    count = len(program.outputs)

    def prepare(root: Any) -> Any:
        """Shard this replica and run ``worker_init_fn``: once, when the first message
        arrives (``SegmentControl``); a failure here fails every epoch."""
        for sharding_root in program.sharding_roots:
            torch.utils.data.graph_settings.apply_sharding(
                sharding_root, setup.num_workers, setup.worker_id, SHARDING_PRIORITIES.MULTIPROCESSING
            )
        if setup.init_fn is not None:
            root = setup.init_fn(root, _worker_info(setup))
            outputs_of(root, count)
        return root

    def reset(root: Any, epoch: int, seed_generator: Any, iter_reset_fn: Any) -> Any:
        del epoch  # the loop has it; the input mux heard of it when the Reset arrived
        if seed_generator is None:  # a front end that seeds its workers itself, in its reset function
            return iter_reset_fn(root) if iter_reset_fn is not None else root
        from torchdata.dataloader2.utils import process_reset_fn

        return process_reset_fn(
            root, _worker_info(setup), seed_generator, iter_reset_fn=iter_reset_fn, custom_reset_fn=setup.reset_fn
        )

    locks = make_locks(program.groups)
    stats = setup.stats or (None,) * len(setup.data)
    liveness = setup.liveness or (None,) * len(setup.data)
    windows = setup.windows or (None,) * len(setup.data)
    lanes = [
        OutputLane(
            sender, locks[k], where, setup.batch_items, stats=stats[k], liveness=liveness[k], window=windows[k]
        )
        for k, sender in enumerate(setup.data)
    ]
    control = SegmentControl(segment_root(program.outputs), count, reset, where, setup=prepare, record=setup.record)
    loop = ChildLoop(setup.control, lanes, control, where, announce=_announcer(mux))
    for placeholder in program.inputs:
        placeholder.child = loop
    loop.run()


def _worker_info(setup: WorkerSetup) -> Any:
    """torchdata's ``WorkerInfo`` for the hooks, made where a hook needs it: a front end
    that seeds its workers itself runs without loading torchdata."""
    from torchdata.dataloader2.utils import WorkerInfo

    return WorkerInfo(setup.num_workers, setup.worker_id)


def _announcer(mux: ChannelMux) -> Callable[[Received], None]:
    """Tell the input mux about a new epoch as soon as the control message arrives."""

    def announce(message: Received) -> None:
        if isinstance(message, Reset):
            mux.advance(message.epoch)

    return announce


def _input_mux(receivers: Sequence[Receiver], names: Sequence[str]) -> ChannelMux:
    index_of = {id(receiver): i for i, receiver in enumerate(receivers)}

    def recv(index: int) -> tuple[int, int, Any]:
        try:
            return receivers[index].recv()
        except EndOfStream:
            return (Kind.END, CLOSED_EPOCH, None)  # the dispatch process stopped: the service is stopping
        except ChannelBroken as exc:
            raise RuntimeError(f"{names[index]}: the dispatch process is gone") from exc

    # Interrupts a wait when a newer epoch is announced or another lane wants a channel
    # this wait does not cover (ChannelMux.advance, ChannelMux._want).
    interrupt = WakePipe()

    def wait(indices: list[int]) -> list[int]:
        ready = wait_readable([receivers[i] for i in indices], also=[interrupt.fd])
        if interrupt.fd in ready:
            interrupt.clear()
        return [index_of[id(r)] for r in ready if id(r) in index_of]

    return ChannelMux(receivers, recv, wait, interrupt.wake)
