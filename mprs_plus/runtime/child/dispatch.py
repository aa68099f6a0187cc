"""The dispatch process: runs the dispatch segment once and deals its items to the workers.

    dispatcher d (lane d) --item k--> channel (d, k mod N) --> worker k mod N

One lane per dispatcher (see ``lanes.py``), each dealing its own items round-robin, in
order, over its own channel to every worker; a full channel blocks that dispatcher only.
That is the backpressure that keeps a slow worker from being buried, and it keeps each
deal deterministic. Dispatchers that share upstream DataPipes (a ``fork`` before two
dispatchers, say) share a compute lock held only inside ``next()``: the dispatch segment
reads no other process, so holding it never waits on a peer.

Per epoch, each dispatcher sends every worker its items and then END; an exception takes
the failing item's place (ERROR to the worker whose turn it was, END to the others).
Seeds are shared ones only: the dispatch process is one process, as in torchdata.

With ``worker_restarts`` each lane keeps what it dealt each worker this epoch, and a
replaced worker is dealt it again over new channels (``Redeal``, ``redeal.py``); a dead
worker's broken channel then never ends a lane.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

from torchdata.dataloader2.utils import WorkerInfo, process_reset_fn

from ...transport import Receiver, Sender
from .control import SegmentControl, make_locks, outputs_of, segment_root
from .loop import ChildLoop
from .lanes import DealLane
from .lifecycle import child_setup
from ..control_messages import Received, Redeal, unpack
from ..data_messages import RemoteError, describe_process
from ...segment import Segment


# Seconds the dispatch process waits for a Redeal's descriptors. They come from the training
# process's resource sharer in milliseconds as a rule; it serves one peer at a time, and
# one that stalls it would otherwise leave the replacement unfed and the loop waiting.
REDEAL_FETCH_SECONDS = 60.0


class DispatchSetup(NamedTuple):
    """Everything the dispatch process starts from (a named tuple, like ``WorkerSetup``)."""

    sources: tuple[Any, ...]  # the copied dispatcher nodes; iterating one runs its part of the segment
    num_workers: int
    control: Receiver  # main -> dispatch
    outputs: tuple[tuple[Sender, ...], ...]  # outputs[d][w]: from dispatcher d to worker w
    init_fn: Callable[..., Any] | None = None
    groups: tuple[int, ...] = (0,)  # dispatchers with the same group share DataPipes (and a lock)
    max_items: int = 64  # at most this many items per message (no more than a channel's capacity)
    stats: tuple[Any, ...] = ()  # a StatsWriter per dispatcher lane, when statistics are collected
    liveness: tuple[Any, ...] = ()  # a LaneLiveness per dispatcher lane (liveness.py)
    redeals: bool = False  # dead workers are replaced: keep each epoch's deal (redeal.py)
    taken: Any = None  # a shared count of the Redeals taken (see _fetched)


def dispatch_main(setup: DispatchSetup) -> None:
    child_setup([setup.control, *(sender for row in setup.outputs for sender in row)])
    where = describe_process(Segment.DISPATCH)
    info = WorkerInfo(setup.num_workers, 0)
    count = len(setup.sources)
    root = segment_root(setup.sources)
    failure: RemoteError | None = None
    if setup.init_fn is not None:
        try:
            root = setup.init_fn(root, info)
            outputs_of(root, count)
        except BaseException as exc:  # user code: any exception is reported (loop.produce)
            failure = RemoteError.capture(exc, where)

    def reset(root: Any, epoch: int, seed_generator: Any, iter_reset_fn: Any) -> Any:
        del epoch
        return process_reset_fn(root, info, seed_generator, distributed_shared_seed=True, iter_reset_fn=iter_reset_fn)

    locks = make_locks(setup.groups)
    stats = setup.stats or (None,) * count
    liveness = setup.liveness or (None,) * count
    lane_class: type[DealLane] = DealLane
    if setup.redeals:
        from .redeal import LoggedDealLane

        lane_class = LoggedDealLane
    lanes = [
        lane_class(setup.outputs[d], locks[d], where, setup.max_items, stats[d], liveness[d]) for d in range(count)
    ]
    control = SegmentControl(root, count, reset, where, failure)
    announce = _redealer(lanes, setup.taken) if setup.redeals else None
    ChildLoop(setup.control, lanes, control, where, announce=announce).run()


def _redealer(lanes: list[Any], taken: Any) -> Callable[[Received], bool]:
    """Handle a ``Redeal`` as it arrives, in the listener thread: each dispatcher starts
    dealing the replaced worker its epoch again over its new channel. ``taken`` counts
    them for the main process, which takes back the ends of those never taken once this
    process is gone (``service.py``)."""

    def announce(message: Received) -> bool:
        if not isinstance(message, Redeal):
            return False
        if taken is not None:
            taken.value += 1  # before the first descriptor is fetched: the main process never fetches it too
        senders = _fetched(message.payload, taken)
        for lane, sender in zip(lanes, senders):
            lane.redeal(message.worker, sender)
        return True

    return announce


def _fetched(payload: bytes, taken: Any) -> Any:
    """A Redeal's channel ends, each end's descriptors fetched from the main process as it
    is unpickled, in a helper thread waited for at most ``REDEAL_FETCH_SECONDS``.

    Where the fetch fails or does not end in time, the replacement can never be fed: this
    process ends (exit status 1, the reason on its stderr), which the main process reports
    at once as the dispatch process's death, rather than leave the loop waiting. A fetch
    that did not end gives its Redeal back to ``taken``: the main process takes back at
    its stop what is still with its sharer (what came here goes with this process)."""
    outcome: list[tuple[bool, Any]] = []

    def fetch() -> None:
        try:
            outcome.append((True, unpack(payload)))
        except BaseException as exc:
            outcome.append((False, exc))

    helper = threading.Thread(target=fetch, name="mprs_plus redeal fetch", daemon=True)
    helper.start()
    helper.join(REDEAL_FETCH_SECONDS)
    if not outcome:
        if taken is not None:
            taken.value -= 1
        print(
            f"mprs_plus dispatch process: the channels of a replaced worker did not come from the training "
            f"process within {REDEAL_FETCH_SECONDS:.0f} s (its multiprocessing resource sharer did not answer)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)
    done, value = outcome[0]
    if not done:
        traceback.print_exception(value)
        os._exit(1)
    return value
