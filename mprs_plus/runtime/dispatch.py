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
from .messages import Kind, RemoteError, describe_process


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
                _deal_error(setup.outputs, epoch, setup_error, turn=0)
                continue
            try:
                seed_generator, iter_reset_fn = payload
                # Shared seeds only: the dispatch process is one process, like torchdata's.
                datapipe = process_reset_fn(
                    datapipe, info, seed_generator, distributed_shared_seed=True, iter_reset_fn=iter_reset_fn
                )
                iterator = iter(datapipe)
            except Exception as exc:
                _deal_error(setup.outputs, epoch, RemoteError.capture(exc, where), turn=0)
                continue
            _deal_epoch(iterator, epoch, setup.control, setup.outputs, where)
    except ChannelError:
        return  # a worker or the main process is gone: the service is stopping
    finally:
        for output in setup.outputs:
            output.close()


def _deal_epoch(iterator: Iterator[Any], epoch: int, control: Any, outputs: tuple[Any, ...], where: str) -> None:
    sends = [output.send for output in outputs]
    count = len(sends)
    turn = 0
    item_kind = Kind.ITEM
    while not control.poll():
        try:
            item = next(iterator)
        except StopIteration:
            for send in sends:
                send((Kind.END, epoch, None))
            return
        except Exception as exc:
            _deal_error(outputs, epoch, RemoteError.capture(exc, where), turn)
            return
        sends[turn]((item_kind, epoch, item))
        turn = turn + 1 if turn + 1 < count else 0


def _deal_error(outputs: tuple[Any, ...], epoch: int, error: RemoteError, turn: int) -> None:
    for offset in range(len(outputs)):
        index = (turn + offset) % len(outputs)
        message = (Kind.ERROR, epoch, error) if offset == 0 else (Kind.END, epoch, None)
        outputs[index].send(message)
