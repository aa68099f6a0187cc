"""How a child applies control messages (``control_messages.py``) to its copy of a segment.

Lane 0 of a child (see ``loop.py``) calls ``SegmentControl.apply`` with every lane parked:

    Reset(e)   reseed and reset the segment, then start every lane's stream for epoch e
               (a restored epoch: each lane first drops the items the user already had)
    Pause      pause() every DataPipe of the segment (graph order), then run pause_fn
    Resume     run resume_fn, then resume() every DataPipe (reverse graph order)
    Limit      run limit_fn(segment, num_batches)

as torchdata's worker and dispatching loops do. Payloads travel pickled on their own, so a
payload that does not unpickle here fails that epoch's streams instead of the whole child.

A child with several outputs hands its hooks one ``SegmentOutputs`` DataPipe holding them.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch.utils.data import IterDataPipe

from ..data_messages import RemoteError
from ..control_messages import Limit, Pause, Received, Reset, Resume, Unreadable, unpack
from ..pausing import pause_datapipes, resume_datapipes
from ..timeline import Span
from .seeding import deferred_numpy_seed

if TYPE_CHECKING:
    from .loop import ChildLoop


class SegmentOutputs(IterDataPipe):
    """The outputs of a segment that has several, as one DataPipe for hooks and graph tools.

    ``worker_init_fn`` / ``worker_reset_fn`` (and ``dispatch_init_fn``) receive this object
    when the worker segment has several outputs (several dispatchers); they may change the
    DataPipes in ``outputs`` (same length, same order) and must return this object.
    """

    def __init__(self, outputs: Sequence[Any]) -> None:
        self.outputs = list(outputs)

    def __iter__(self) -> Any:
        raise TypeError("SegmentOutputs is not iterated: each of its outputs is, by its own lane")

    def __repr__(self) -> str:
        return f"SegmentOutputs({', '.join(type(dp).__name__ for dp in self.outputs)})"


def segment_root(outputs: Sequence[Any]) -> Any:
    """What hooks receive: the output itself when there is one, else ``SegmentOutputs``."""
    return outputs[0] if len(outputs) == 1 else SegmentOutputs(outputs)


def outputs_of(root: Any, count: int) -> list[Any]:
    """The lanes' DataPipes, read back from what a hook returned."""
    if count == 1:
        if not isinstance(root, IterDataPipe):
            raise TypeError(f"a hook returned {type(root).__name__}; it must return an IterDataPipe")
        return [root]
    outputs = getattr(root, "outputs", None)
    if not isinstance(root, SegmentOutputs) or not isinstance(outputs, list) or len(outputs) != count:
        raise TypeError(
            f"this segment has {count} outputs, so its hooks receive a SegmentOutputs and must return it "
            f"with {count} DataPipes in .outputs; got {root!r}"
        )
    return outputs


def make_locks(groups: Sequence[int]) -> list[threading.Lock | None]:
    """One compute lock per group of lanes that share DataPipes; None for a lane alone."""
    sizes: dict[int, int] = {}
    for group in groups:
        sizes[group] = sizes.get(group, 0) + 1
    locks = {group: threading.Lock() for group, size in sizes.items() if size > 1}
    return [locks.get(group) for group in groups]


ResetFn = Callable[[Any, int, Any, Any], Any]  # (root, epoch, seed_generator, iter_reset_fn) -> root


class SegmentControl:
    """The segment's root DataPipe, and the control messages applied to it (one ``match``)."""

    def __init__(
        self,
        root: Any,
        count: int,
        reset: ResetFn,
        where: str,
        failure: RemoteError | None = None,
        setup: Callable[[Any], Any] | None = None,
        record: Any = None,
    ) -> None:
        self.root = root
        # Where the generators are recorded as each epoch begins, when the service replaces
        # dead workers (``generators.GeneratorRecord``); None otherwise.
        self._record = record
        self.count = count
        self._reset = reset
        self._where = where
        self._failure = failure  # set-up failed: every epoch ends with this error
        self._deferred: RemoteError | None = None  # a hook failed between epochs: reported once
        # The child's one-time set-up (root -> root), run when its first message arrives:
        # a child started ahead of its first epoch then waits without using the CPU that
        # the main process needs to start the others.
        self._setup = setup

    def apply(self, message: Received, loop: ChildLoop) -> None:
        """Apply ``message``; called on lane 0 with every other lane parked."""
        if self._setup is not None:
            setup, self._setup = self._setup, None
            began = time.perf_counter()
            try:
                self.root = setup(self.root)
            except BaseException as exc:  # user code: any exception is reported (loop.produce)
                self._failure = RemoteError.capture(exc, self._where)
            stats = loop.lanes[0].stats
            if stats is not None and stats.trace is not None:  # on the timeline: its set-up
                stats.trace.span(Span.STARTUP, began, time.perf_counter())
        if isinstance(message, Unreadable):  # a control message that could not be read at all
            self._report(loop, message.error)
            return
        try:
            value = unpack(message.payload)
        except BaseException as exc:
            error = RemoteError.capture(exc, self._where)
            if isinstance(message, Reset):
                loop.begin_epoch(message.epoch)
                loop.fail_all(error, every=True)
            else:
                self._report(loop, error)
            return
        try:
            match message:
                case Reset(epoch=epoch, skip=skip):
                    self._begin_epoch(loop, epoch, value, skip, message.restore, message.lost, message.careful)
                case Pause():
                    loop.paused = True
                    pause_datapipes(self.root)
                    if value is not None:
                        self.root = value(self.root)
                case Resume():
                    loop.paused = False
                    if value is not None:
                        self.root = value(self.root)
                    resume_datapipes(self.root)
                case Limit():
                    num_batches, limit_fn = value
                    if limit_fn is not None:
                        self.root = limit_fn(self.root, num_batches)
        except BaseException as exc:
            self._report(loop, RemoteError.capture(exc, self._where))

    def _report(self, loop: ChildLoop, error: RemoteError) -> None:
        if loop.streaming:
            loop.fail_all(error)
        else:
            self._deferred = error

    def _begin_epoch(
        self,
        loop: ChildLoop,
        epoch: int,
        value: Any,
        skip: tuple[int, ...] = (),
        restore: bytes = b"",
        lost: tuple[int, ...] = (),
        careful: int = 0,
    ) -> None:
        loop.begin_epoch(epoch)
        error, self._deferred = self._failure or self._deferred, None
        if error is not None:
            loop.fail_all(error, every=True)
            return
        seed_generator, iter_reset_fn = value
        try:
            if self._record is not None:
                from .. import generators

                # A replacement: the record of its predecessor it starts from. The reset
                # function loads its dataset's state, ``begin_epoch`` its generators after it.
                generators.prepare(restore)
            # numpy.random is loaded only if the pipeline uses it; a reset without a seed
            # generator seeds the segment itself (a front end's own reset function).
            with deferred_numpy_seed() if seed_generator is not None else contextlib.nullcontext():
                self.root = self._reset(self.root, epoch, seed_generator, iter_reset_fn)
            outputs = outputs_of(self.root, self.count)
            if self._record is not None:
                generators.begin_epoch(self._record, epoch)
        except BaseException as exc:
            loop.fail_all(RemoteError.capture(exc, self._where), every=True)
            return
        for k, output in enumerate(outputs):
            loop.start(k, output, skip[k] if k < len(skip) else 0, lost[k] if k < len(lost) else -1, careful)
