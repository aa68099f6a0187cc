"""mprs_plus: a multiprocessing reading service for torchdata's DataLoader2 that splits
the DataPipe graph where its markers say, and never silently runs it in one process."""

from .errors import AmbiguousGraphError, PlanError, ProcessDiedError, ServiceClosedError, WorkerError
from .graph import NoGraph
from .plan import Plan, Segment, plan
from .reading_service import MultiProcessingReadingService

__all__ = [
    "AmbiguousGraphError",
    "MultiProcessingReadingService",
    "NoGraph",
    "Plan",
    "PlanError",
    "ProcessDiedError",
    "Segment",
    "ServiceClosedError",
    "WorkerError",
    "plan",
]
