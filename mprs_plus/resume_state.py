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

Counts are taken where the items leave the service for the user, so items a worker
produced ahead (in channels, in the reader's batches) are not consumed: after a restore
each worker is re-seeded as at the start of the epoch and drops its first ``consumed[w]``
items itself, without sending them anywhere.
"""

from __future__ import annotations

import enum
import pickle
from dataclasses import dataclass

_MAGIC = "mprs_plus.checkpoint"
_VERSION = 1


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
        if record.get("version") != _VERSION:
            raise ValueError(f"checkpoint format version {record.get('version')} is not supported (this is {_VERSION})")
        state = cls(
            num_workers=int(record["num_workers"]),
            in_order=bool(record["in_order"]),
            phase=Phase(record["phase"]),
            seed_state=record["seed_state"],
            consumed=tuple(int(n) for n in record["consumed"]),
            next_worker=int(record["next_worker"]),
            main_skip=int(record.get("main_skip", 0)),
        )
        if state.phase is Phase.RUNNING and (
            len(state.consumed) != state.num_workers or state.seed_state is None or min(state.consumed, default=0) < 0
        ):
            raise ValueError("a damaged checkpoint: its per-worker counts do not match its worker count")
        return state

    def check_workers(self, num_workers: int) -> None:
        """A checkpoint resumes only with the worker count it was taken with: the items each
        worker produces depend on it (sharding, round-robin)."""
        if num_workers != self.num_workers:
            raise ValueError(
                f"this checkpoint was taken with num_workers={self.num_workers} and cannot be restored with "
                f"num_workers={num_workers}: the items each worker produces depend on the worker count. "
                f"Restore it with num_workers={self.num_workers}."
            )
