"""Items for an accelerator: page-locked (``pin_memory=True``) and, with ``device=``, already
on the device when the loop gets them, copied on the service's own stream ahead of the loop.

::

    main segment --> pin: every tensor page-locked --> user's loop
                     (lent ones already are: the lend areas are registered, _lend.py;
                      others are copied into page-locked memory)

    main segment --> [side stream] copy item k+1 .. k+ahead to the device --> item k:
                     the loop's current stream waits on k's copy event (on the device,
                     not in this thread), and k's tensors are marked used by that stream

Why page-lock the lend areas instead of copying into pinned memory, as torch's DataLoader
does in a thread: a lent tensor is already in the training process's memory; registering
the area makes it DMA-able where it lies, so the user's own ``.to(device,
non_blocking=True)`` reads the worker's bytes at the bus's speed and the loop's thread is
free meanwhile. What a copy may still read when the user drops a buffer is kept from the
sender until the device has passed a fence recorded at the drop (``_lend.py``).

Why a side stream for ``device=``: copies enqueued on the loop's own stream would queue
behind its compute; on a stream of their own they overlap the step. The loop's stream then
waits for each item's copy on the device (``wait_event``), and each tensor is recorded as
used by that stream (``record_stream``), so the caching allocator never hands its memory
out again before the loop's work on it is done. Host items are pulled and dropped while the
side stream is current, so the lend rule's fence for their extents follows their copies.

The device calls sit behind two small objects, ``CudaPageLocker`` and ``CudaMover``, so
that the run-ahead and release rules are tested without a device (fakes of the same
methods). Without CUDA, ``pin_memory=True`` warns and leaves items as they are, as torch's
DataLoader does; ``device=`` is an error that says so.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch.utils.data import IterDataPipe

from ...transport import lending
from ...user_frame import warn
from ...transport._lend import lock_pages_with

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device context
# Seconds a closing feed gives copies still in flight to finish, so that the lend areas they
# read are unmapped with the service; past it they go back whenever lending() looks next.
SETTLE = 1.0
_SETTLE_POLL = 0.001


@dataclass
class FeedCounters:
    """What the feeding did so far (``stats().device``)."""

    device: str = ""  # where items were moved, "" when only pinned
    items: int = 0  # items handed to the loop
    bytes_to_device: int = 0  # tensor bytes copied to the device
    pinned_copies: int = 0  # tensors that were not page-locked and were copied into such memory
    # Items handed out while their copy was still running: the loop's stream waited on it
    # (on the device). Many mean the copies, not the workers, pace the loop.
    waited_on_copy: int = 0


def map_tensors(item: Any, fn: Callable[[Any], Any]) -> Any:
    """``item`` with ``fn`` applied to every tensor in it, through tuples (named ones too),
    lists and mappings, as torch's DataLoader pins them; anything else is kept as it is."""
    import torch

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return fn(value)
        if isinstance(value, (str, bytes)):
            return value
        if isinstance(value, tuple):
            walked = [walk(v) for v in value]
            return type(value)(*walked) if hasattr(value, "_fields") else type(value)(walked)
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, Mapping):
            walked_map = {k: walk(v) for k, v in value.items()}
            try:
                return type(value)(walked_map)
            except TypeError:
                return walked_map
        return value

    return walk(item)


class CudaPageLocker:
    """``_lend.PageLocker`` with CUDA's calls: registration, events, the pinned allocator."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._cudart = torch.cuda.cudart()
        self._warned = False

    def register(self, address: int, nbytes: int) -> bool:
        error = int(self._cudart.cudaHostRegister(address, nbytes, _HOST_REGISTER_PORTABLE))
        if error and not self._warned:
            self._warned = True
            warn(
                f"pin_memory: the device refused to page-lock a {nbytes >> 20} MiB lend area (CUDA error "
                f"{error}); its tensors are copied into pinned memory instead, which costs the main process "
                "a copy per item. Too little lockable memory (ulimit -l in a container) is the usual cause.",
                RuntimeWarning,
            )
        return error == 0

    def unregister(self, address: int) -> None:
        self._cudart.cudaHostUnregister(address)

    def fence(self) -> Any:
        event = self._torch.cuda.Event()
        event.record()
        return event

    def passed(self, token: Any) -> bool:
        return bool(token.query())

    def allocate(self, nbytes: int) -> Any:
        torch = self._torch
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()


class CudaMover:
    """Copies an item's tensors to ``device`` on a stream of its own; hands them out to the
    current stream of the thread that takes them."""

    def __init__(self, device: Any, counters: FeedCounters) -> None:
        import torch

        self._torch = torch
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(self.device)
        self._counters = counters

    def side(self) -> Any:
        """A context in which the side stream is current."""
        return self._torch.cuda.stream(self._stream)

    def start(self, box: list[Any]) -> tuple[Any, Any]:
        """Enqueue the copies of the item in ``box`` (taken out of it, so that its last
        reference dies here, on the side stream); the moved item and its copy's event."""
        torch, device, counters = self._torch, self.device, self._counters

        def move(tensor: Any) -> Any:
            if tensor.device.type != "cpu":
                return tensor.to(device, non_blocking=True)
            if not tensor.is_pinned():
                counters.pinned_copies += 1
                tensor = tensor.pin_memory()
            counters.bytes_to_device += tensor.nbytes
            return tensor.to(device, non_blocking=True)

        moved = map_tensors(box.pop(), move)
        event = torch.cuda.Event()
        event.record(self._stream)
        return moved, event

    def hand_out(self, moved: Any, event: Any) -> tuple[Any, bool]:
        """The item for the current stream, and whether its copy was still running."""
        current = self._torch.cuda.current_stream(self.device)
        running = not event.query()
        current.wait_event(event)

        def used_by_current(tensor: Any) -> Any:
            if tensor.device == self.device:
                tensor.record_stream(current)
            return tensor

        return map_tensors(moved, used_by_current), running


def feed_ahead(source: Any, mover: Any, ahead: int, counters: FeedCounters) -> Iterator[Any]:
    """Items of ``source`` moved by ``mover``, ``ahead`` of them enqueued before the first
    is handed out and one more each time one is: the copy of the next items runs while the
    loop works on this one.

    An error of the source is raised once the items before it were handed out, as raised
    (its traceback is the worker's). The side stream is current only while this pulls and
    enqueues, never while the loop runs."""
    iterator = iter(source)
    pending: deque[tuple[Any, Any]] = deque()
    error: BaseException | None = None
    ended = False
    while True:
        while not ended and len(pending) < ahead:
            with mover.side():
                try:
                    box = [next(iterator)]
                except StopIteration:
                    ended = True
                    break
                except BaseException as exc:  # handed on after the items before it
                    ended, error = True, exc
                    break
                pending.append(mover.start(box))
        if not pending:
            if error is not None:
                try:
                    raise error
                finally:
                    error = None
            return
        moved, event = pending.popleft()
        item, running = mover.hand_out(moved, event)
        counters.items += 1
        counters.waited_on_copy += running
        yield item


def pin_each(source: Any, counters: FeedCounters) -> Iterator[Any]:
    """Items of ``source`` with every tensor page-locked (lent ones already are)."""

    def pin(tensor: Any) -> Any:
        if tensor.device.type != "cpu" or tensor.is_pinned():
            return tensor
        counters.pinned_copies += 1
        return tensor.pin_memory()

    for item in source:
        counters.items += 1
        yield map_tensors(item, pin)


class FedPipe(IterDataPipe):
    """The main segment as the loop gets it: pinned, or moved to the device ahead.

    Graph walks (torch's ``traverse_dps``, which pickles) see the main segment behind it,
    never the feeding and its device stream; copies are the same object, as the service's
    own reader is."""

    def __init__(self, main: Any, feeding: Feeding) -> None:
        self.main = main
        self._feeding = feeding

    def __getstate__(self) -> dict[str, Any]:
        return {"main": self.main}

    def __deepcopy__(self, memo: dict[int, Any]) -> FedPipe:
        return self

    def __len__(self) -> int:
        return len(self.main)


def _iterate_fed(pipe: FedPipe) -> Iterator[Any]:
    return pipe._feeding.iterate(pipe.main)


# Assigned after the class is made, as the service's reader is: torch's DataPipe metaclass
# wraps an ``__iter__`` of the class body with per-item bookkeeping.
FedPipe.__iter__ = _iterate_fed  # type: ignore[method-assign]


class Feeding:
    """The service's feeding, as the options ask: ``wrap`` the main segment with it."""

    def __init__(self, device: Any, ahead: int, mover_factory: Callable[[Any, FeedCounters], Any] | None = None) -> None:
        self.counters = FeedCounters(device=str(device) if device is not None else "")
        self.ahead = ahead if device is not None else 0
        self._device = device
        self._mover: Any = None
        self._mover_factory = mover_factory or CudaMover

    @property
    def delivery(self) -> str:
        """How items reach the loop, for ``Plan.explain()``."""
        if self._device is None:
            return "page-locked (pin_memory=True): lent tensors are pinned where they lie, others copied into pinned memory"
        return (
            f"on {self._device}: every tensor copied there on the service's own stream, up to {self.ahead} "
            "items ahead of the loop, from page-locked memory"
        )

    def wrap(self, main: Any) -> FedPipe:
        return main if isinstance(main, FedPipe) else FedPipe(main, self)

    def iterate(self, main: Any) -> Iterator[Any]:
        if self._device is None:
            return pin_each(main, self.counters)
        if self._mover is None:
            self._mover = self._mover_factory(self._device, self.counters)
        return feed_ahead(main, self._mover, self.ahead, self.counters)

    def close(self) -> None:
        """After the stop: give back what waits for copies that have finished by now, for at
        most ``SETTLE`` seconds (a lend area is unmapped only once nothing of it waits),
        then stop page-locking if no other service of this process asks for it."""
        deadline = time.monotonic() + SETTLE
        while lending().awaiting_device and time.monotonic() < deadline:
            time.sleep(_SETTLE_POLL)  # a bounded poll of the device's events: nothing to wait on
        _release_locker()


_lockers = 0
_lockers_lock = threading.Lock()


def _install_locker() -> None:
    """Page-lock lend areas in this process while some service asks for it."""
    global _lockers
    with _lockers_lock:
        if _lockers == 0:
            lock_pages_with(CudaPageLocker())
        _lockers += 1


def _release_locker() -> None:
    global _lockers
    with _lockers_lock:
        if _lockers == 0:
            return
        _lockers -= 1
        if _lockers == 0:
            lock_pages_with(None)  # areas locked so far stay so until their channels go


def open_feeding(pin_memory: bool, device: Any, ahead: int) -> Feeding | None:
    """The feeding ``pin_memory`` and ``device`` ask for, None when they ask for none or
    (with a warning, as torch's DataLoader) when there is no accelerator to pin for."""
    if not pin_memory:
        return None
    import torch

    if not torch.cuda.is_available():
        if device is not None:
            raise RuntimeError(
                f"device={str(device)!r}: CUDA is not available in this process, so items cannot be moved "
                "there. Leave device=None (items stay in host memory), or run where torch.cuda.is_available()."
            )
        warn(
            "pin_memory=True, but no accelerator is available: items are not page-locked. "
            "Leave pin_memory=False on this machine to silence this warning.",
            UserWarning,
        )
        return None
    _install_locker()
    return Feeding(device, ahead)
