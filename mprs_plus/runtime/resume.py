"""Checkpoint and restore on the runtime side: what to record, and how to resume.

    checkpoint  capture(...)      the main reader's cursor (items handed out per worker,
                                  whose turn is next) + the epoch's seed generator state
    restore     check_restorable  the same worker count, a shape that can resume
                begin the epoch   the seed generator set back, in place, to the recorded
                                  state; every worker re-seeded as at the epoch start, told
                                  to drop its first consumed[w] items itself (``child.py``);
                                  the in-order reader starts at the recorded turn

Why it is exact: with ``in_order=True`` the items the user gets are worker 0, 1, ..., N-1
round-robin, each worker's stream depends only on its seed and on its share of the input,
so "worker w's items after its first consumed[w]" from "worker next_worker on" is the
uninterrupted rest of the epoch. With ``in_order=False`` the same per-worker counts make
the remaining *set* exact; its order depends on timing, as it always does.

What stays exact only by replay: with a dispatch process, the dispatch segment deals the
epoch again from its start, and each worker drops the dispatched items behind its skipped
outputs (the count of inputs behind a worker's output is not known without running it).
Nothing skipped reaches the main process.

What is refused, with a ``ValueError`` at ``checkpoint()``: a mid-epoch checkpoint of a main
segment that is more than one worker output read as is (main-process DataPipes such as a
shuffle or a join hold state of their own this service does not record), and of a service
running in-process (``num_workers=0``).
"""

from __future__ import annotations

import pickle
from typing import Any

from ..resume_state import Phase, ResumeState
from .service import ServiceRuntime, WorkerReader


def capture(
    num_workers: int, in_order: bool, runtime: ServiceRuntime | None, main: Any, epoch_seed: bytes | None
) -> ResumeState:
    """The state of the epoch as the user has seen it; ``epoch_seed``: the pickled seed
    generator as the current epoch received it, None before the first epoch."""
    if epoch_seed is None:
        return ResumeState(num_workers, in_order, Phase.NOT_STARTED)
    check_resumable(runtime, main)
    assert runtime is not None
    cursor = runtime.read_cursor()
    if cursor is None:
        raise RuntimeError("internal error: an epoch began without a read cursor")
    if cursor.ended:
        return ResumeState(num_workers, in_order, Phase.ENDED)
    return ResumeState(
        num_workers, in_order, Phase.RUNNING, epoch_seed, tuple(cursor.consumed), cursor.next_worker
    )


def check_resumable(runtime: ServiceRuntime | None, main: Any) -> None:
    if runtime is None:
        raise ValueError(
            "a mid-epoch checkpoint needs worker processes (num_workers >= 1): with num_workers=0 the whole "
            "pipeline runs in the calling process, and its position is not recorded"
        )
    if not isinstance(main, WorkerReader):
        raise ValueError(
            "a mid-epoch checkpoint needs the main process to hand out the workers' items as they are: this "
            f"pipeline runs {type(main).__name__} in the main process, whose own state (a buffer, a position) is "
            "not recorded. Move it into the worker segment (before the last non-replicable DataPipe), or "
            "checkpoint between epochs"
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
