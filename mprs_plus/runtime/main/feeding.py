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

Which device: ``device=`` names it (``"cuda"`` is resolved, with its index, when the
loader's iterator is made, as torch resolves ``.to("cuda")``); with ``pin_memory=True``
alone it is the device current then, as torch's DataLoader pins for (``pin_device``).
Registration runs there. Fences are recorded on the current stream of every device with a
context, since the service does not see which device or stream the loop copies on.

The device calls sit behind small objects, ``CudaPageLocker`` and ``CudaMover`` over
``CudaCalls``, so that the run-ahead and release rules, and which device and stream each
call uses, are tested without a device (fakes of the same methods). Without CUDA,
``pin_memory=True`` warns and leaves items as they are, as torch's DataLoader does;
``device=`` is an error that says so.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, MutableSequence, Sequence
from dataclasses import dataclass
from typing import Any

from torch.utils.data import IterDataPipe

from ...transport import lending
from ...user_frame import warn
from ...transport._lend import lock_pages_with, pinning_receivers

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


def map_tensors(item: Any, fn: Callable[[Any], Any], custom: Callable[[Any], Any] | None = None) -> Any:
    """``item`` with ``fn`` applied to every tensor in it, walked as torch's pin-memory loop
    walks a batch (``torch.utils.data._utils.pin_memory.pin_memory``): through mappings and
    sequences, which keep their type (a mutable one is copied and updated, so a
    ``defaultdict`` keeps its ``default_factory`` and a custom list its attributes), tuples
    (named ones too). An object that is none of these is given to ``custom`` (its own
    ``pin_memory()``, for instance), or kept as it is."""
    import copy

    import torch

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return fn(value)
        kind = type(value)
        if kind is dict:  # the common cases first, without the generic copies below
            return {k: walk(v) for k, v in value.items()}
        if kind is list:
            return [walk(v) for v in value]
        if kind is tuple:
            return tuple(walk(v) for v in value)
        if custom is not None and not isinstance(value, (str, bytes)):
            handled = custom(value)
            if handled is not _UNHANDLED:
                return handled
        if isinstance(value, (str, bytes)):
            return value
        if isinstance(value, Mapping):
            walked = {k: walk(v) for k, v in value.items()}
            try:
                if isinstance(value, MutableMapping):
                    clone = copy.copy(value)
                    clone.update(walked)
                    return clone
                return kind(walked)
            except TypeError:
                return walked
        if isinstance(value, tuple):
            if hasattr(value, "_fields"):  # a named tuple
                return kind(*(walk(v) for v in value))
            return kind(walk(v) for v in value)
        if isinstance(value, Sequence):
            walked_items = [walk(v) for v in value]
            try:
                if isinstance(value, MutableSequence):
                    clone = copy.copy(value)
                    for index, walked_item in enumerate(walked_items):
                        clone[index] = walked_item
                    return clone
                return kind(walked_items)
            except TypeError:
                return walked_items
        return value

    return walk(item)


_UNHANDLED = object()  # what a ``custom`` of ``map_tensors`` returns for an object it leaves alone


def _own_pin_memory(value: Any) -> Any:
    """A batch type's own ``pin_memory()``, called as torch's pin-memory loop calls it."""
    pin = getattr(value, "pin_memory", None)
    return pin() if callable(pin) else _UNHANDLED


class CudaCalls:
    """The CUDA calls of the feeding, in one place: torch's here, a test's fake of the same
    methods elsewhere (``tests/test_gpu_seams.py``), so that which device, stream and call
    each step uses is checked without a device."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._cuda = torch.cuda
        # Whether a device has a context already, without making one (torch's pinned
        # allocator asks the same); a torch without it leaves the answer unknown.
        self._has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)

    def available(self) -> bool:
        return bool(self._cuda.is_available())

    def host_register(self, address: int, nbytes: int, flags: int) -> tuple[int, str]:
        """``cudaHostRegister``: its error code (0: registered) and that error's text."""
        cudart = self._cuda.cudart()
        return _status(cudart, cudart.cudaHostRegister(address, nbytes, flags))

    def host_unregister(self, address: int) -> tuple[int, str]:
        cudart = self._cuda.cudart()
        return _status(cudart, cudart.cudaHostUnregister(address))

    def current_device(self) -> int:
        return int(self._cuda.current_device())

    def set_device(self, index: int) -> None:
        self._cuda.set_device(index)

    def device(self, index: int) -> Any:
        """A context in which ``index`` is this thread's current device."""
        return self._cuda.device(index)

    def devices_with_context(self) -> list[int] | None:
        """The devices this process has a context on (None: unknown)."""
        if self._has_context is None:
            return None
        return [index for index in range(self._cuda.device_count()) if self._has_context(index)]

    def relaxed(self) -> Any:
        """A context in which this thread's CUDA calls cannot break a graph that another
        thread captures (``_RelaxedCapture``); a no-op where CUDA's runtime is not found."""
        exchange = _capture_mode_exchange()
        return _RelaxedCapture(exchange) if exchange is not None else contextlib.nullcontext()

    def capturing(self, index: int) -> bool:
        """Whether the current stream of device ``index`` captures a CUDA graph."""
        with self._cuda.device(index):
            return bool(self._cuda.is_current_stream_capturing())

    def new_stream(self, index: int) -> Any:
        return self._cuda.Stream(index)

    def stream_context(self, stream: Any) -> Any:
        return self._cuda.stream(stream)

    def current_stream(self, index: int) -> Any:
        return self._cuda.current_stream(index)

    def new_event(self) -> Any:
        return self._cuda.Event()

    def pinned_empty(self, nbytes: int) -> Any:
        """A page-locked uint8 tensor of ``nbytes`` from torch's pinned allocator."""
        torch = self._torch
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


_CAPTURE_MODE_RELAXED = 2  # cudaStreamCaptureModeRelaxed
_exchange: Any = None  # cudaThreadExchangeStreamCaptureMode of this process's CUDA runtime; False: not found


def _capture_mode_exchange() -> Any:
    """``cudaThreadExchangeStreamCaptureMode`` from the CUDA runtime torch loaded (found
    among this process's mappings, so that it is the same library and state), or None."""
    global _exchange
    if _exchange is None:
        found: Any = None
        try:
            import ctypes

            with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
                paths = {line.split()[-1] for line in maps if "libcudart" in line and "/" in line}
            for path in sorted(paths):
                function = getattr(ctypes.CDLL(path), "cudaThreadExchangeStreamCaptureMode", None)
                if function is not None:
                    function.restype = ctypes.c_int
                    function.argtypes = [ctypes.POINTER(ctypes.c_int)]
                    found = function
                    break
        except (OSError, ValueError):
            pass  # no /proc (not Linux) or no loadable runtime: the guard is a no-op
        if found is not None:
            _exchange = found
        else:
            import torch

            if torch.cuda.is_initialized():
                _exchange = False  # CUDA runs without a runtime of its own to find: settled
    return _exchange or None


class _RelaxedCapture:
    """This thread's stream-capture mode set to relaxed, and restored on exit.

    In CUDA's default (global) capture mode, which ``torch.cuda.graph`` uses, a thread
    that makes a "potentially unsafe" call (an event query, a host registration, an
    allocation) while *another* thread captures invalidates that capture. The feeding's
    calls run on whatever thread takes items: the loop's, or a prefetch thread such as
    torchdata's ``pin_memory()``. The mode is per thread; relaxed lifts the prohibition
    for this thread's calls only (NCCL-style libraries do the same in their own threads),
    and none of the calls made here touches a capturing stream: the fence is not recorded
    on this thread's own capturing stream (``CudaPageLocker``)."""

    __slots__ = ("_exchange", "_mode")

    def __init__(self, exchange: Any) -> None:
        import ctypes

        self._exchange = exchange
        self._mode = ctypes.c_int(_CAPTURE_MODE_RELAXED)

    def __enter__(self) -> None:
        import ctypes

        self._mode.value = _CAPTURE_MODE_RELAXED
        if self._exchange(ctypes.byref(self._mode)) != 0:
            self._mode.value = -1  # not exchanged: nothing to restore

    def __exit__(self, *exc: object) -> None:
        import ctypes

        if self._mode.value >= 0:
            self._exchange(ctypes.byref(self._mode))


def _status(cudart: Any, error: Any) -> tuple[int, str]:
    code = int(error)
    if code == 0:
        return 0, ""
    try:
        return code, str(cudart.cudaGetErrorString(error))
    except Exception:  # the text is for the warning only
        return code, f"CUDA error {code}"


def resolve_device(device: Any, calls: Any) -> Any:
    """``device`` with its index: ``"cuda"`` is the current device now, as torch resolves it
    in ``.to("cuda")``. Tensors are then compared by index, never with an index-less device
    (``cuda:0 != cuda``)."""
    import torch

    resolved = torch.device(device)
    if resolved.index is None:
        resolved = torch.device(resolved.type, calls.current_device())
    return resolved


def pin_device(calls: Any) -> int:
    """The device to page-lock for when no device is named: the current one, as torch's
    DataLoader pins for the device current when its iterator is made, unless that device
    has no context yet and another has (a rank that moved its model to ``cuda:rank`` without
    ``set_device``): then that one, as torch's pinned allocator does, so that no context is
    made on a device this process never uses."""
    current = calls.current_device()
    with_context = calls.devices_with_context()
    if with_context and current not in with_context:
        return with_context[0]
    return current


class _Fence:
    """The release fence of one dropped buffer: an event on the current stream of every
    device a copy may have been enqueued on. ``events`` is None while it could not be
    recorded (a graph was being captured, or the call failed): it is recorded at a later
    look, which orders after the same work, and until then it has not passed."""

    __slots__ = ("events",)

    def __init__(self) -> None:
        # (device, its current stream, an event recorded there)
        self.events: list[tuple[int, Any, Any]] | None = None


class CudaPageLocker:
    """``_lend.PageLocker`` with CUDA's calls: registration, events, the pinned allocator.

    Registration runs on ``device`` (named by ``device=``, else ``pin_device``), on a thread
    of its own: a refused ``cudaHostRegister`` leaves CUDA's last error set in the thread
    that called it (torch's binding does not clear it), and in the loop's thread the next
    kernel launch would raise it as its own. The short-lived thread takes the error with it.

    Fences are recorded on the current stream of every device with a context (where a
    ``.to(device, non_blocking=True)`` of the loop may have enqueued its copy), never during
    a CUDA graph capture (a record or query there would break the capture)."""

    def __init__(self, calls: Any = None, device: int | None = None) -> None:
        self._calls = calls if calls is not None else CudaCalls()
        self.device = pin_device(self._calls) if device is None else device
        self.devices = {self.device}  # the feeds' devices: fenced when contexts are unknown
        self._warned = False
        # Pinned copies (``allocate``) whose last view died, kept from torch's allocator
        # until their fence passes: (the pinned tensor, its fence).
        self._copies_waiting: list[tuple[Any, _Fence]] = []
        self._reaping = threading.Lock()  # held by the one reaper of that list (never waited for)

    def register(self, address: int, nbytes: int) -> bool:
        error, text = self._on_own_thread(self._calls.host_register, address, nbytes, _HOST_REGISTER_PORTABLE)
        if error and not self._warned:
            self._warned = True
            warn(
                f"pin_memory: CUDA refused to page-lock a {nbytes >> 20} MiB lend area on cuda:{self.device} "
                f"(cudaHostRegister: {text}, error {error}). Its tensors are copied into pinned memory instead, "
                "which costs the main process a copy per item; see 'Feeding a GPU' in the docs for when "
                "registration is refused.",
                RuntimeWarning,
            )
        return error == 0

    def unregister(self, address: int) -> None:
        self._on_own_thread(self._calls.host_unregister, address)

    def _on_own_thread(self, call: Callable[..., tuple[int, str]], *args: Any) -> tuple[int, str]:
        """``call(*args)`` with this locker's device current, on a thread that ends with it."""
        outcome: list[Any] = []

        def run() -> None:
            try:
                self._calls.set_device(self.device)
                with self._calls.relaxed():  # a new thread starts in the global mode
                    outcome.append(call(*args))
            except BaseException as exc:  # raised in the caller's thread below
                outcome.append(exc)

        thread = threading.Thread(target=run, name="mprs_plus page-lock", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # no new thread at interpreter exit: nothing runs after it anyway
            run()
        else:
            thread.join()
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    def fence(self) -> _Fence:
        fence = _Fence()
        with self._calls.relaxed():
            self._record(fence)
        return fence

    def passed(self, token: _Fence, blocked: set[Any] | None = None) -> bool:
        """Whether the fence passed. ``blocked`` (one set per look over fences made in
        order) holds the streams seen with an event not yet passed: events on one stream
        pass in order, so a later fence on such a stream has not passed either, and is not
        asked (a look then costs a query per stream, not per fence waiting)."""
        with self._calls.relaxed():
            if token.events is None:
                self._record(token)
                return False  # recorded only now: the work before it is still to be passed
            try:
                if blocked and any(stream in blocked for _, stream, _ in token.events):
                    return False
                if self._capturing(index for index, _, _ in token.events):
                    return False
                for _, stream, event in token.events:
                    if not event.query():
                        if blocked is not None:
                            blocked.add(stream)
                        return False
                return True
            except Exception:  # not known to have passed: asked again at the next look
                return False

    def _record(self, fence: _Fence) -> None:
        calls = self._calls
        known = calls.devices_with_context()
        devices = sorted(self.devices) if known is None else known
        try:
            if self._capturing(devices):
                return
            events = []
            for index in devices:
                event = calls.new_event()
                stream = calls.current_stream(index)
                event.record(stream)
                events.append((index, stream, event))
        except Exception:
            return
        fence.events = events

    def _capturing(self, devices: Iterable[int]) -> bool:
        return any(self._calls.capturing(index) for index in devices)

    def allocate(self, nbytes: int) -> Any:
        """Pinned memory for a buffer copied out of a lend area. torch's pinned allocator
        keeps a block from reuse after a copy only when the copy's tensor starts at the
        block's start; a view at an offset (a slice of the batch) is not covered. So the
        block is held here, from the death of the last view until a fence passes."""
        self._reap_copies()
        with self._calls.relaxed(), self._calls.device(self.device):
            block = self._calls.pinned_empty(nbytes)
        out = block.numpy()
        weakref.finalize(out, self._copy_dropped, block).atexit = False
        return out

    def _copy_dropped(self, block: Any) -> None:
        # The fence first: its device calls may run a finalizer that reaps (the list is
        # then read after them, never before).
        fence = self.fence()
        self._copies_waiting.append((block, fence))

    def _reap_copies(self) -> None:
        """Let go of the pinned copies whose fences passed. One reaper at a time, as the
        transport's (``_lend._reap_awaiting``): a copy dropped meanwhile, by another thread
        or by a finalizer inside a device call here, is appended past the part looked at,
        which alone is rewritten (one slice assignment)."""
        if not self._reaping.acquire(blocking=False):
            return
        try:
            waiting = self._copies_waiting
            count = len(waiting)
            blocked: set[Any] = set()
            waiting[:count] = [entry for entry in waiting[:count] if not self.passed(entry[1], blocked)]
        finally:
            self._reaping.release()

    @property
    def copies_waiting(self) -> int:
        self._reap_copies()
        return len(self._copies_waiting)


class CudaMover:
    """Copies an item's tensors to ``device`` on a stream of its own; hands them out to the
    current stream of the thread that takes them."""

    def __init__(self, device: Any, counters: FeedCounters, calls: Any = None) -> None:
        self._calls = calls if calls is not None else CudaCalls()
        self.device = resolve_device(device, self._calls)
        self._stream = self._calls.new_stream(self.device.index)
        self._counters = counters

    @contextlib.contextmanager
    def side(self) -> Iterator[None]:
        """A context in which the side stream is current (and this thread's calls cannot
        break another thread's graph capture: ``_RelaxedCapture``)."""
        with self._calls.relaxed(), self._calls.stream_context(self._stream):
            yield

    def start(self, box: list[Any]) -> tuple[Any, Any]:
        """Enqueue the copies of the item in ``box`` (taken out of it, so that its last
        reference dies here, on the side stream); the moved item and its copy's event."""
        device, counters = self.device, self._counters

        def move(tensor: Any) -> Any:
            if tensor.device.type != "cpu":
                return tensor.to(device, non_blocking=True)
            if not tensor.is_pinned():
                counters.pinned_copies += 1
                tensor = tensor.pin_memory()
            counters.bytes_to_device += tensor.nbytes
            return tensor.to(device, non_blocking=True)

        moved = map_tensors(box.pop(), move, _pinned_for_hand_out)
        event = self._calls.new_event()
        event.record(self._stream)
        return moved, event

    def hand_out(self, moved: Any, event: Any) -> tuple[Any, bool]:
        """The item for the current stream, and whether its copy was still running."""
        index = self.device.index
        with self._calls.relaxed():
            current = self._calls.current_stream(index)
            running = not event.query()
            current.wait_event(event)

            def used_by_current(tensor: Any) -> Any:
                if tensor.is_cuda and tensor.device.index == index:
                    tensor.record_stream(current)
                return tensor

            def move_own(value: Any) -> Any:
                if not isinstance(value, _MoveAtHandOut):
                    return _UNHANDLED
                try:
                    return value.batch.to(self.device, non_blocking=True)
                except TypeError:  # a ``to`` without that keyword
                    return value.batch.to(self.device)

            return map_tensors(moved, used_by_current, move_own), running


class _MoveAtHandOut:
    """A batch type's own object (with a ``to`` method), pinned by its own ``pin_memory()``
    ahead and moved by its own ``to`` on the loop's stream when handed out: the service
    cannot mark the tensors inside it as used by the loop's stream (``record_stream``), so
    memory allocated on the side stream could be reused under the loop's kernels."""

    __slots__ = ("batch",)

    def __init__(self, batch: Any) -> None:
        self.batch = batch


def _pinned_for_hand_out(value: Any) -> Any:
    """``device=``'s rule for an object that is neither a tensor nor a container: pinned by
    its own ``pin_memory()`` if it has one, and moved by its own ``to`` at hand-out."""
    pinned = _own_pin_memory(value)
    if pinned is _UNHANDLED:
        pinned = value
    if callable(getattr(pinned, "to", None)):
        return _MoveAtHandOut(pinned)
    return pinned if pinned is not value else _UNHANDLED


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
        del moved
        held = [item]
        del item  # the loop's batch is held by no local past its yield (cursor.py, handed_on)
        counters.items += 1
        counters.waited_on_copy += running
        yield held.pop()


def pin_each(source: Any, counters: FeedCounters, calls: Any = None) -> Iterator[Any]:
    """Items of ``source`` with every tensor page-locked (lent ones already are). The
    items are taken and pinned with this thread's capture mode relaxed (``calls``), so
    that the first lend's registration, the fences and torch's pinned allocator cannot
    break a graph another thread captures; the loop's own code runs in its own mode."""

    def pin(tensor: Any) -> Any:
        if tensor.device.type != "cpu" or tensor.is_pinned():
            return tensor
        counters.pinned_copies += 1
        return tensor.pin_memory()

    relaxed = calls.relaxed if calls is not None else contextlib.nullcontext
    iterator = iter(source)
    while True:
        with relaxed():
            try:
                item = next(iterator)
            except StopIteration:
                return
            held = [map_tensors(item, pin, _own_pin_memory)]
            del item
        counters.items += 1
        yield held.pop()  # held by no local past its yield (cursor.py, handed_on)


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
    """The service's feeding, as the options ask: ``wrap`` the main segment with it, and
    make the service's channels inside ``channels()``.

    No CUDA call is made until the first item is taken (``arm``): under fork, the
    workers start with the first epoch, and a process whose CUDA is initialised leaves
    its forked children unable to use it (torch's DataLoader, too, forks its workers
    before it asks for the current device). The device is resolved then, and the
    process's locker installed for this feeding; ``close`` undoes that once, however
    often it is called (a loader's finalizer and its ``stop()`` both call it)."""

    def __init__(
        self,
        device: Any,
        ahead: int,
        mover_factory: Callable[[Any, FeedCounters], Any] | None = None,
        calls: Any = None,
        pin_device: Any = None,
    ) -> None:
        self.counters = FeedCounters(device=str(device) if device is not None else "")
        self.ahead = ahead if device is not None else 0
        self._device = device
        self._pin_device = pin_device  # pin_memory_device, when the loader names one
        self._calls = calls
        self._mover: Any = None
        self._mover_factory = mover_factory or CudaMover
        self._armed = False
        self._lease: list[bool] = []  # [True] while this feeding holds the locker: popped once

    @property
    def delivery(self) -> str:
        """How items reach the loop, for ``Plan.explain()``."""
        if self._device is None:
            return "page-locked (pin_memory=True): lent tensors are pinned where they lie, others copied into pinned memory"
        return (
            f"on {self._device}: every tensor copied there on the service's own stream, up to {self.ahead} "
            "items ahead of the loop, from page-locked memory"
        )

    def channels(self) -> Any:
        """A context in which the service's channels are made: only theirs are page-locked."""
        return pinning_receivers()

    def wrap(self, main: Any) -> FedPipe:
        return main if isinstance(main, FedPipe) else FedPipe(main, self)

    def arm(self) -> None:
        """Resolve the device and install the locker: at the first item, after the fork."""
        if self._armed or self._calls is None:
            return
        self._armed = True
        calls = self._calls
        lending()  # gives back what an earlier service left waiting, if its fences passed by now
        if self._device is not None:
            self._device = resolve_device(self._device, calls)
            self.counters.device = str(self._device)
            index = self._device.index
        elif self._pin_device is not None:
            index = resolve_device(self._pin_device, calls).index
        else:
            index = pin_device(calls)
        _install_locker(calls, index)
        self._lease.append(True)

    def iterate(self, main: Any) -> Iterator[Any]:
        self.arm()
        if self._device is None:
            return pin_each(main, self.counters, self._calls)
        if self._mover is None:
            self._mover = self._mover_factory(self._device, self.counters)
        return feed_ahead(main, self._mover, self.ahead, self.counters)

    def close(self) -> None:
        """After the stop: give back what waits for copies that have finished by now, for at
        most ``SETTLE`` seconds (a lend area is unlocked and unmapped only once nothing of it
        waits), then stop page-locking if no other service of this process asks for it.
        What still waits then goes back at the next look: the next loader's start, or any
        lend, copy or drop (``_lend.py``); never from a thread of ours, whose event queries
        could break a CUDA graph another thread captures. Idempotent."""
        deadline = time.monotonic() + SETTLE
        while _still_waiting() and time.monotonic() < deadline:
            time.sleep(_SETTLE_POLL)  # a bounded poll of the device's events: nothing to wait on
        try:
            self._lease.pop()  # atomic: of two closes racing, one releases
        except IndexError:
            return
        _release_locker()


def _still_waiting() -> bool:
    locker = _the_locker
    return bool(lending().awaiting_device or (locker is not None and locker.copies_waiting))


_lockers = 0
_lockers_lock = threading.Lock()
# One locker for the process, kept across services, so that what a closed service left
# waiting (pinned copies, fences) is looked at again by the next one.
_the_locker: CudaPageLocker | None = None


def _install_locker(calls: Any, device: int) -> None:
    """Page-lock lend areas in this process while some service asks for it; registration
    runs on the device of the first service of a run of them, fences cover every device."""
    global _lockers, _the_locker
    with _lockers_lock:
        if _the_locker is None:
            _the_locker = CudaPageLocker(calls, device)
        elif _lockers == 0:
            _the_locker.device, _the_locker.devices = device, {device}
        else:
            _the_locker.devices.add(device)
        if _lockers == 0:
            lock_pages_with(_the_locker, marked_only=True)  # only the pinning loaders' channels
        _lockers += 1


def _release_locker() -> None:
    global _lockers
    with _lockers_lock:
        if _lockers == 0:
            return
        _lockers -= 1
        if _lockers == 0:
            lock_pages_with(None)  # areas locked so far stay so until their channels go


def open_feeding(pin_memory: bool, device: Any, ahead: int, pin_memory_device: Any = None) -> Feeding | None:
    """The feeding ``pin_memory`` and ``device`` ask for, None when they ask for none or
    (with a warning, as torch's DataLoader) when there is no accelerator to pin for.
    ``pin_memory_device`` (torch's DataLoader argument): the CUDA device to pin for when
    ``device`` is not given; another accelerator's is not supported (a warning, and
    items are pinned for the CUDA device current at the first item)."""
    if not pin_memory:
        return None
    calls = CudaCalls()
    if not calls.available():
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
    pin_for = None
    if pin_memory_device:
        import torch

        try:
            pin_for = torch.device(pin_memory_device)
        except (RuntimeError, TypeError):
            pin_for = None
        if pin_for is None or pin_for.type != "cuda":
            warn(
                f"pin_memory_device={pin_memory_device!r}: only CUDA devices are supported; items are pinned "
                "for the CUDA device current when the first item is taken. Leave pin_memory_device unset, "
                "or name a CUDA device ('cuda:1').",
                UserWarning,
            )
            pin_for = None
    return Feeding(
        device,
        ahead,
        mover_factory=lambda where, counters: CudaMover(where, counters, calls),
        calls=calls,
        pin_device=pin_for,
    )
