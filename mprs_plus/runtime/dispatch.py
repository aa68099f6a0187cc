"""The dispatch process: runs the dispatch segment once and deals its items to workers.

States (driven by the control channel from the main process)::

    IDLE --RESET(e)--> RUNNING(e): item k goes to worker k mod N, in order
        RUNNING --exhausted--> END(e) to every worker --> IDLE
        RUNNING --exception--> ERROR(e) to the worker whose turn it was, END(e) to the rest
        RUNNING --control message waiting--> IDLE (the message is handled next)
    IDLE/RUNNING --STOP or control closed--> close every worker channel, exit

A worker channel that is full blocks the dispatcher: that is the backpressure that
keeps a slow worker from being buried, and it keeps the deal deterministic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torchdata.dataloader2.utils import WorkerInfo, process_reset_fn

from ..transport import ChannelBroken, ChannelError, EndOfStream
from .lifecycle import child_setup
from .messages import Batcher, Kind, RemoteError, describe_process


@dataclass
class DispatchSetup:
    source: Any  # the copied dispatcher node; iterating it runs the dispatch segment
    num_workers: int
    control: Any  # receiver: main -> dispatch
    outputs: tuple[Any, ...]  # senders: dispatch -> worker w
    init_fn: Callable[..., Any] | None = None


def dispatch_main(setup: DispatchSetup) -> None:
    child_setup([setup.control, *setup.outputs])
    where = describe_process("dispatch process")
    info = WorkerInfo(setup.num_workers, 0)
    datapipe = setup.source
    setup_error: RemoteError | None = None
    if setup.init_fn is not None:
        try:
            datapipe = setup.init_fn(datapipe, info)
        except Exception as exc:
            setup_error = RemoteError.capture(exc, where)
    try:
        while True:
            try:
                kind, epoch, payload = setup.control.recv()
            except (EndOfStream, ChannelBroken):
                return
            if kind == Kind.STOP:
                return
            if setup_error is not None:
                _deal_error([Batcher(o.send, epoch) for o in setup.outputs], setup_error, turn=0)
                continue
            try:
                seed_generator, iter_reset_fn = payload
                # Shared seeds only: the dispatch process is one process, like torchdata's.
                datapipe = process_reset_fn(
                    datapipe, info, seed_generator, distributed_shared_seed=True, iter_reset_fn=iter_reset_fn
                )
                iterator = iter(datapipe)
            except Exception as exc:
                _deal_error([Batcher(o.send, epoch) for o in setup.outputs], RemoteError.capture(exc, where), turn=0)
                continue
            _deal_epoch(iterator, epoch, setup.control, setup.outputs, where)
    except ChannelError:
        return  # a worker or the main process is gone: the service is stopping
    finally:
        for output in setup.outputs:
            output.close()


def _deal_epoch(iterator: Iterator[Any], epoch: int, control: Any, outputs: tuple[Any, ...], where: str) -> None:
    batchers = [Batcher(output.send, epoch) for output in outputs]
    adds = [batcher.add for batcher in batchers]
    count = len(adds)
    turn = 0
    poll = control.poll
    while not poll():
        try:
            item = next(iterator)
        except StopIteration:
            for batcher in batchers:
                batcher.finish(Kind.END)
            return
        except Exception as exc:
            _deal_error(batchers, RemoteError.capture(exc, where), turn)
            return
        adds[turn](item)
        turn = turn + 1 if turn + 1 < count else 0
    for batcher in batchers:
        batcher.flush()


def _deal_error(batchers: list[Batcher], error: RemoteError, turn: int) -> None:
    """The error takes the failing item's place in the deal; the other workers end."""
    for offset in range(len(batchers)):
        batcher = batchers[(turn + offset) % len(batchers)]
        batcher.finish(Kind.ERROR, error) if offset == 0 else batcher.finish(Kind.END)
