"""Checkpoint and restore on the runtime side: what to record, and how to resume.

    checkpoint  capture(...)      the main reader's cursor (items handed out per worker,
                                  whose turn is next) + the epoch's seed generator state
                                  + the planned graph's fingerprint (``fingerprint``)
    restore     check_workers,    the same worker count, the same graph split the same way
                check_graph,      between processes, a seed generator of DataLoader2's type
                check_shape
                begin the epoch   the seed generator set back, in place, to the recorded
                                  state; every worker re-seeded as at the epoch start, told
                                  to drop its first consumed[w] items itself (``child/loop.py``);
                                  the in-order reader starts at the recorded turn

Why it is exact: with ``in_order=True`` the items the user gets are worker 0, 1, ..., N-1
round-robin, each worker's stream depends only on its seed and on its share of the input,
so "worker w's items after its first consumed[w]" from "worker next_worker on" is the
uninterrupted rest of the epoch. With ``in_order=False`` the same per-worker counts make
the remaining *set* exact; its order depends on timing, as it always does.

A worker segment whose last DataPipe has ``resume_from(n)`` (documented on the checkpoint
page) starts there instead of producing and dropping ``n`` items: the one hook, never a guess.

What stays exact only by replay: with a dispatch process, the dispatch segment deals the
epoch again from its start, and each worker drops the dispatched items behind its skipped
outputs (the count of inputs behind a worker's output is not known without running it).
Nothing skipped reaches the main process.

A main segment with DataPipes of its own (a shuffle, a join, the ``fullsync`` that
``DistributedReadingService`` adds) holds state this service does not record; so does a
service running in-process (``num_workers=0``). Then the items the user received are counted
after the whole main segment (``MainCounter``), and a restore replays the epoch from its
start through the main segment, which drops that many items before handing any out: exact
with ``in_order=True``; with ``in_order=False`` the replayed order differs, so such a
checkpoint is refused mid-epoch with a ``ValueError``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch.utils.data import IterDataPipe
from torchdata.dataloader2.random import SeedGenerator

from ...plan import Plan
from .cursor import ReadCursor

if TYPE_CHECKING:
    from ...resume_state import ResumeState


def _record() -> Any:
    """The checkpoint record's module, loaded when a checkpoint is taken or restored: not
    on the path to a loader's first item."""
    from ... import resume_state

    return resume_state


class MainCounter(IterDataPipe):
    """The outermost DataPipe of a main segment that holds state of its own: counts the items
    handed to the user this epoch, and drops the first ``skip`` of a restored epoch.

    The count is a ``ReadCursor`` of one source, the main segment, as the workers' reader
    keeps one per worker; it is taken before each item is yielded, that is when it leaves
    for the user."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.cursor = ReadCursor(1)
        self._skip = 0

    def begin(self, skip: int = 0) -> None:
        """A new epoch; a restored one first drops ``skip`` items."""
        self.cursor, self._skip = ReadCursor(1), skip


def _iterate_counted(self: MainCounter) -> Iterator[Any]:
    cursor = self.cursor
    consumed = cursor.consumed
    items = iter(self.source)
    skip, self._skip = self._skip, 0
    for _ in range(skip):
        try:
            next(items)
        except StopIteration:
            break
        consumed[0] += 1
    held: list[Any] = []  # no local keeps a handed-out item past its yield (cursor.py, handed_on)
    while True:
        try:
            held.append(next(items))
        except StopIteration:
            break
        consumed[0] += 1
        yield held.pop()
    cursor.ended = True


# Assigned after the class is made, as for the workers' reader: torch's DataPipe metaclass
# would wrap an ``__iter__`` of the class body with per-item bookkeeping.
MainCounter.__iter__ = _iterate_counted  # type: ignore[method-assign]


def fingerprint(plan: Plan) -> str:
    """What a checkpoint's counts are about: every node's type, segment and parents, and
    which nodes cross between processes. Pure, and only the plan's *what runs where*: the
    start method, the backend or the hosts the segments run on do not enter it, so that a
    checkpoint restores wherever the same pipeline runs. Types go by qualified name without
    their module, so that a class defined in a script (``__main__``) and later imported from
    a module is still the same."""
    lines = [f"workers {plan.num_workers > 0}", f"dispatchers {plan.dispatchers}", f"outputs {plan.worker_outputs}"]
    for node in plan.graph.nodes:
        kind = type(plan.graph.datapipes[node.index])
        segment = plan.segments[node.index].value
        lines.append(f"{node.index} {kind.__qualname__} {segment} {node.parents}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32]


def capture(
    num_workers: int,
    in_order: bool,
    runtime: Any,
    counter: MainCounter | None,
    epoch_seed: bytes | None,
) -> ResumeState:
    """The state of the epoch as the user has seen it; ``epoch_seed``: the pickled seed
    generator as the current epoch received it, None before the first epoch."""
    record = _record()
    ResumeState, Phase = record.ResumeState, record.Phase  # noqa: N806
    if epoch_seed is None:
        return ResumeState(num_workers, in_order, Phase.NOT_STARTED)
    if counter is not None:
        if counter.cursor.ended:
            return ResumeState(num_workers, in_order, Phase.ENDED)
        if not in_order and runtime is not None and runtime.in_processes:
            raise ValueError(
                "a mid-epoch checkpoint of a pipeline with DataPipes in the main process needs in_order=True: "
                "its main segment is replayed from the epoch start on restore, and with in_order=False the "
                "replayed order differs. Use in_order=True, or checkpoint between epochs"
            )
        skip = counter.cursor.consumed[0]
        return ResumeState(num_workers, in_order, Phase.RUNNING, epoch_seed, (0,) * num_workers, 0, main_skip=skip)
    cursor = runtime.read_cursor() if runtime is not None else None
    if cursor is None:
        raise RuntimeError("internal error: an epoch began without a read cursor")
    if cursor.ended:
        return ResumeState(num_workers, in_order, Phase.ENDED)
    return ResumeState(
        num_workers, in_order, Phase.RUNNING, epoch_seed, tuple(cursor.consumed), cursor.next_worker
    )


def check_shape(state: ResumeState, counter: MainCounter | None) -> None:
    """A checkpoint counted after the main segment restores only into one that is counted
    there too, and the other way round: otherwise the pipeline changed shape."""
    if state.phase is not _record().Phase.RUNNING:
        return
    if (counter is None and state.main_skip > 0) or (counter is not None and any(state.consumed)):
        raise ValueError(
            "this checkpoint was taken with a pipeline split differently between the processes (DataPipes "
            "were added to or removed from the main process): restore it with the pipeline it was taken with"
        )


def seed_state(seed_generator: Any) -> bytes:
    """The seed generator as an epoch receives it, to hand the same one to a restored epoch."""
    return pickle.dumps(seed_generator)


def set_seed_state(seed_generator: Any, state: bytes) -> None:
    """Make ``seed_generator`` (the one ``DataLoader2`` owns and hands in every epoch) equal to
    the recorded one, in place: the restored epoch draws the epoch's seeds again, and what
    it leaves in the generator is what the uninterrupted run left, so later epochs match.

    torchdata's ``SeedGenerator`` keeps its engines in private fields; its own pickling
    methods (``__getstate__`` / ``__setstate__``) are the documented way in and out."""
    recorded = pickle.loads(state)
    if type(recorded) is not type(seed_generator):
        raise ValueError(
            f"the checkpoint's seed generator is a {type(recorded).__name__}, DataLoader2 handed a "
            f"{type(seed_generator).__name__}"
        )
    seed_generator.__setstate__(recorded.__getstate__())


class Checkpoints:
    """The reading service's checkpoint side, in one object so that the adapter only calls it.

        adapt(main, counted)       what DataLoader2 iterates: the main segment, wrapped in a
                                   ``MainCounter`` unless the runtime's reader counts it
                                   (one worker output as is)
        begin_epoch(generator)     a restored epoch: set the generator back; record the
                                   epoch's seeds; returns what each worker skips, whose
                                   turn is first (nothing and worker 0 for a normal epoch)
        checkpoint(runtime)        the bytes for ``DataLoader2.state_dict()``
        planned(plan)              the plan of the pipeline (after planning, before restoring)
        load(bytes) / arm(state)   read and check a checkpoint; the next epoch resumes it
    """

    def __init__(self, num_workers: int, in_order: bool) -> None:
        self._num_workers = num_workers
        self._in_order = in_order
        self._epoch_seed: bytes | None = None  # the seed generator as the current epoch received it
        self._restored: ResumeState | None = None  # resumed by the next begin_epoch
        self._counter: MainCounter | None = None
        self._graph: str | None = None  # the planned graph's fingerprint

    def planned(self, plan: Plan) -> None:
        self._graph = fingerprint(plan)

    def adapt(self, main: Any, counted_by_reader: bool) -> Any:
        if counted_by_reader:
            return main
        if self._counter is None:
            self._counter = MainCounter(main)
        self._counter.source = main
        return self._counter

    def begin_epoch(self, seed_generator: Any) -> tuple[tuple[int, ...], int]:
        restored, self._restored = self._restored, None
        if restored is not None and restored.seed_state is not None:
            set_seed_state(seed_generator, restored.seed_state)
        self._epoch_seed = seed_state(seed_generator)
        if self._counter is not None:
            self._counter.begin(restored.main_skip if restored is not None else 0)
        if restored is None or not any(restored.consumed):
            return (), 0
        return restored.consumed, restored.next_worker

    def checkpoint(self, runtime: Any) -> bytes:
        state = capture(self._num_workers, self._in_order, runtime, self._counter, self._epoch_seed)
        return dataclasses.replace(state, graph=self._graph).to_bytes()

    def load(self, serialized_state: bytes) -> ResumeState:
        state = _record().ResumeState.from_bytes(serialized_state)
        state.check_workers(self._num_workers)
        if state.seed_state is not None and not isinstance(pickle.loads(state.seed_state), SeedGenerator):
            raise ValueError(
                "a damaged checkpoint: its field 'seed_state' is wrong (it is not the seed generator DataLoader2 "
                "hands out). Restore an intact one, or start without it."
            )
        return state

    def arm(self, state: ResumeState) -> None:
        """Resume ``state`` in the next epoch (after ``planned`` and ``adapt``); ValueError if
        it was taken of another pipeline, or of one split differently between processes."""
        if self._graph is not None:
            state.check_graph(self._graph)
        if state.phase is _record().Phase.RUNNING:
            check_shape(state, self._counter)
            self._restored = state
