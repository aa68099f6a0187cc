"""The worker process: runs one replica of the worker segment and streams its output.

States (driven by the control channel from the main process)::

    IDLE --RESET(e)--> RUNNING(e) --last item--> send END(e) --> IDLE
                        |---exception--> send ERROR(e) --> IDLE
                        +---control message waiting--> IDLE (the message is handled next)
    IDLE/RUNNING --STOP or control closed--> exit

Between two items the worker looks at its control channel, so a new epoch or a stop
is seen within one item. The worker never rediscovers the graph: it receives its
segment ready to run, with ``DispatchedInput`` placeholders where the dispatch
process feeds it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch.utils.data.graph_settings
from torch.utils.data import IterDataPipe
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2.utils import WorkerInfo, process_reset_fn

from ..transport import ChannelBroken, ChannelError, EndOfStream
from .lifecycle import child_setup
from .messages import Batcher, Kind, RemoteError, describe_process


def _nothing() -> None:
    return None


class DispatchedInput(IterDataPipe):
    """Stands in the worker's copy of the graph where a dispatcher was: yields the items
    the dispatch process hands to this worker for the current epoch."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.receiver: Any = None
        self.epoch = 0
        # Called before blocking on the dispatch process: the worker flushes the items it
        # holds, so that nobody waits on items stuck in a batch.
        self.before_wait: Callable[[], None] = _nothing
        self._pushed_back: tuple[int, int, Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        while True:
            message = self._next_message()
            if message is None:
                return
            kind, epoch, payload = message
            if epoch < self.epoch:
                continue  # left over from an abandoned epoch
            if epoch > self.epoch:
                # The dispatch process is already in the next epoch: keep the message
                # for it and end this one; the worker loop picks up the RESET next.
                self._pushed_back = message
                return
            if kind == Kind.ITEMS:
                yield from payload
            elif kind == Kind.END:
                return
            else:
                raise payload.rebuild()

    def _next_message(self) -> tuple[int, int, Any] | None:
        if self._pushed_back is not None:
            message, self._pushed_back = self._pushed_back, None
            return message
        try:
            if not self.receiver.poll():
                self.before_wait()
            return self.receiver.recv()
        except EndOfStream:
            return None  # the dispatch process stopped: the service is shutting down
        except ChannelBroken as exc:
            raise RuntimeError(f"{self.name}: the dispatch process is gone") from exc


@dataclass
class WorkerProgram:
    """What a worker runs: its copy of the segment, built once in the main process."""

    output: Any
    inputs: tuple[DispatchedInput, ...]
    sharding_roots: tuple[Any, ...]


@dataclass
class WorkerSetup:
    worker_id: int
    num_workers: int
    program: WorkerProgram
    control: Any  # receiver: main -> this worker
    data: Any  # sender: this worker -> main
    inputs: tuple[Any, ...]  # receivers: dispatch -> this worker, one per DispatchedInput
    init_fn: Callable[..., Any] | None
    reset_fn: Callable[..., Any] | None


def worker_main(setup: WorkerSetup) -> None:
    child_setup([setup.control, setup.data, *setup.inputs])
    where = describe_process("worker", setup.worker_id)
    info = WorkerInfo(setup.num_workers, setup.worker_id)
    program = setup.program
    for placeholder, receiver in zip(program.inputs, setup.inputs):
        placeholder.receiver = receiver
    try:
        for root in program.sharding_roots:
            torch.utils.data.graph_settings.apply_sharding(
                root, setup.num_workers, setup.worker_id, SHARDING_PRIORITIES.MULTIPROCESSING
            )
        datapipe = program.output
        if setup.init_fn is not None:
            datapipe = setup.init_fn(datapipe, info)
    except Exception as exc:
        _report_setup_failure(setup, RemoteError.capture(exc, where))
        return
    _serve(setup, datapipe, info, where)


def _serve(setup: WorkerSetup, datapipe: Any, info: WorkerInfo, where: str) -> None:
    control, data = setup.control, setup.data
    try:
        while True:
            try:
                kind, epoch, payload = control.recv()
            except (EndOfStream, ChannelBroken):
                return
            if kind == Kind.STOP:
                return
            try:
                seed_generator, iter_reset_fn = payload
                for placeholder in setup.program.inputs:
                    placeholder.epoch = epoch
                datapipe = process_reset_fn(
                    datapipe, info, seed_generator, iter_reset_fn=iter_reset_fn, custom_reset_fn=setup.reset_fn
                )
                iterator = iter(datapipe)
            except Exception as exc:
                data.send((Kind.ERROR, epoch, RemoteError.capture(exc, where)))
                continue
            _run_epoch(iterator, Batcher(data.send, epoch), control, setup.program.inputs, where)
    except ChannelError:
        return  # the main process closed its end: it is stopping or gone
    finally:
        data.close()


def _run_epoch(
    iterator: Iterator[Any], batcher: Batcher, control: Any, inputs: tuple[DispatchedInput, ...], where: str
) -> None:
    for placeholder in inputs:
        placeholder.before_wait = batcher.flush
    add = batcher.add
    poll = control.poll
    while not poll():
        try:
            item = next(iterator)
        except StopIteration:
            batcher.finish(Kind.END)
            return
        except Exception as exc:
            batcher.finish(Kind.ERROR, RemoteError.capture(exc, where))
            return
        add(item)
    batcher.flush()


def _report_setup_failure(setup: WorkerSetup, error: RemoteError) -> None:
    """A worker that cannot start answers every RESET with the error until STOP."""
    try:
        while True:
            kind, epoch, _ = setup.control.recv()
            if kind == Kind.STOP:
                return
            setup.data.send((Kind.ERROR, epoch, error))
    except ChannelError:
        return
    finally:
        setup.data.close()
