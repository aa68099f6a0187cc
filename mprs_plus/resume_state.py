"""The bytes a checkpoint holds, and the checks a restore makes: pure, no processes.

    ResumeState
      num_workers     the service's worker count; a restore with another count is refused
      in_order        how the items were read (informational: a restore may read either way)
      phase           NOT_STARTED   no epoch began: a restore starts as a new service does
                      RUNNING       part of an epoch was handed to the user: resume it
                      ENDED         the epoch was read to its end: the next epoch comes next
      seed_state      the seed generator as the epoch received it (pickled), so that the
                      resumed epoch draws the same seeds and the later ones follow on
      consumed        per worker, the items the user received from it this epoch
      next_worker     in order: whose turn the next item is
      main_skip       a main segment with DataPipes of its own (or num_workers=0): the items
                      the user received from it; it is replayed from the epoch start and
                      drops that many (``consumed`` is then all zeros)
      graph           a fingerprint of the planned graph (each node's type, segment and
                      parents): a restore into another pipeline is refused. Nothing about
                      where the segments run (start method, backend) enters it, so a
                      checkpoint restores on any backend

Counts are taken where the items leave the service for the user, so items a worker
produced ahead (in channels, in the reader's batches) are not consumed: after a restore
each worker is re-seeded as at the start of the epoch and drops its first ``consumed[w]``
items itself, without sending them anywhere.

Reading checks the record against itself: every field present with its type, counts in
range (``next_worker`` a worker, no count below 0, in-order counts that a round-robin can
reach), a seed state that unpickles. Anything else is a ``ValueError`` naming the field:
a damaged checkpoint would otherwise lose or reorder items silently.
"""

from __future__ import annotations

import enum
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_MAGIC = "mprs_plus.checkpoint"
_VERSION = 2  # 2: adds ``graph``; a version 1 record (without it) still loads, unchecked


class Phase(str, enum.Enum):
    NOT_STARTED = "not_started"
    RUNNING = "running"
    ENDED = "ended"


@dataclass(frozen=True)
class ResumeState:
    num_workers: int
    in_order: bool
    phase: Phase
    seed_state: bytes | None = None
    consumed: tuple[int, ...] = ()
    next_worker: int = 0
    main_skip: int = 0
    graph: str | None = None  # the planned graph's fingerprint; None: not planned yet, or version 1

    def to_bytes(self) -> bytes:
        record = {
            "magic": _MAGIC,
            "version": _VERSION,
            "num_workers": self.num_workers,
            "in_order": self.in_order,
            "phase": self.phase.value,
            "seed_state": self.seed_state,
            "consumed": list(self.consumed),
            "next_worker": self.next_worker,
            "main_skip": self.main_skip,
            "graph": self.graph,
        }
        # Plain built-in types only, so that loading it never imports anything.
        return pickle.dumps(record, protocol=4)

    @classmethod
    def from_bytes(cls, data: bytes) -> ResumeState:
        """Read a checkpoint; anything not written by ``to_bytes`` is a ``ValueError``."""
        if not isinstance(data, (bytes, bytearray)):
            raise ValueError(f"a checkpoint of this service is bytes, got {type(data).__name__}")
        try:
            record = pickle.loads(data)
        except Exception as exc:
            raise ValueError("this is not a checkpoint of mprs_plus.MultiProcessingReadingService") from exc
        if not isinstance(record, dict) or record.get("magic") != _MAGIC:
            raise ValueError("this is not a checkpoint of mprs_plus.MultiProcessingReadingService")
        version = record.get("version")
        if version not in (1, _VERSION):
            raise ValueError(f"checkpoint format version {version!r} is not supported (this is {_VERSION})")
        field = _Fields(record)
        num_workers = field("num_workers", _count)
        phase = field("phase", _phase)
        state = cls(
            num_workers=num_workers,
            in_order=field("in_order", _bool),
            phase=phase,
            seed_state=field("seed_state", _seed_state),
            consumed=field("consumed", _counts),
            next_worker=field("next_worker", _count),
            main_skip=field("main_skip", _count, default=0),
            graph=field("graph", _fingerprint) if version >= 2 else None,
        )
        state._check()
        return state

    def _check(self) -> None:
        """The fields agree with each other: those of an epoch under way describe one that
        a reader can have reached, the others are empty."""
        if self.phase is not Phase.RUNNING:
            for name, value, empty in (
                ("seed_state", self.seed_state, None),
                ("consumed", self.consumed, ()),
                ("next_worker", self.next_worker, 0),
                ("main_skip", self.main_skip, 0),
            ):
                if value != empty:
                    raise _damaged(name, f"it is {value!r} in phase {self.phase.value!r}, which records no position")
            return
        if self.seed_state is None:
            raise _damaged("seed_state", "an epoch under way needs the seed state it began with")
        if len(self.consumed) != self.num_workers:
            raise _damaged(
                "consumed", f"it holds {len(self.consumed)} counts for num_workers={self.num_workers}"
            )
        if self.num_workers and not 0 <= self.next_worker < self.num_workers:
            raise _damaged("next_worker", f"{self.next_worker} is not a worker of num_workers={self.num_workers}")
        if not self.num_workers and self.next_worker:
            raise _damaged("next_worker", f"{self.next_worker} with num_workers=0, which has no worker")
        if self.main_skip and any(self.consumed):
            raise _damaged("main_skip", "it is counted after the main segment, so every per-worker count is 0 then")
        if self.in_order and self.consumed:
            # Read in order, worker w had at most as many items as the worker whose turn is
            # next, one more if its turn came before (fewer only if it ended early).
            turn = self.consumed[self.next_worker]
            for w, count in enumerate(self.consumed):
                if count > turn + (1 if w < self.next_worker else 0):
                    raise _damaged(
                        "consumed",
                        f"worker {w} had {count} items but worker {self.next_worker}, whose turn is next, had {turn}: "
                        "a read in order cannot get there",
                    )

    def check_workers(self, num_workers: int) -> None:
        """A checkpoint resumes only with the worker count it was taken with: the items each
        worker produces depend on it (sharding, round-robin)."""
        if num_workers != self.num_workers:
            raise ValueError(
                f"this checkpoint was taken with num_workers={self.num_workers} and cannot be restored with "
                f"num_workers={num_workers}: the items each worker produces depend on the worker count. "
                f"Restore it with num_workers={self.num_workers}."
            )

    def check_graph(self, graph: str) -> None:
        """A checkpoint resumes only the pipeline it was taken of: its counts mean nothing
        for another graph."""
        if self.graph is not None and self.graph != graph:
            raise ValueError(
                "this checkpoint was taken of another pipeline (its field 'graph', a fingerprint of the DataPipes, "
                "their types and how they connect, differs from this pipeline's): restoring it would lose or "
                "reorder items. Restore it with the pipeline it was taken of (DataLoader2.from_state does), or "
                "start a new epoch without it."
            )


_NO_DEFAULT = object()


class _Fields:
    """Reads the fields of a record, each a ``ValueError`` naming it when missing or wrong."""

    def __init__(self, record: dict[str, Any]) -> None:
        self._record = record

    def __call__(self, name: str, convert: Callable[[Any], Any], default: Any = _NO_DEFAULT) -> Any:
        if name not in self._record:
            if default is not _NO_DEFAULT:
                return default
            raise _damaged(name, "it is missing")
        value = self._record[name]
        try:
            return convert(value)
        except (TypeError, ValueError) as exc:
            raise _damaged(name, f"{value!r:.80} is not {exc}") from None


def _damaged(name: str, why: str) -> ValueError:
    return ValueError(
        f"a damaged checkpoint: its field {name!r} is wrong ({why}). Restore an intact one, or start without it."
    )


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError("an int >= 0")
    return value


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError("True or False")
    return value


def _phase(value: Any) -> Phase:
    try:
        return Phase(value)
    except ValueError:
        raise TypeError("one of " + ", ".join(repr(p.value) for p in Phase)) from None


def _counts(value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise TypeError("a list of ints >= 0")
    try:
        return tuple(_count(n) for n in value)
    except TypeError:
        raise TypeError("a list of ints >= 0") from None


def _seed_state(value: Any) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, bytes):
        raise TypeError("bytes")
    try:
        pickle.loads(value)
    except Exception:
        raise TypeError("a pickled seed generator (it does not unpickle)") from None
    return value


def _fingerprint(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError("a fingerprint (str)")
    return value
