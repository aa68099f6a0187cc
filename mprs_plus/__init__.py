"""mprs_plus: a multiprocessing reading service for torchdata's DataLoader2 that splits
the DataPipe graph where its markers say, and never silently runs it in one process.

The public names load on first use (PEP 562), so that ``python -m mprs_plus`` can quiet
torchdata's import-time deprecation banner in its own process before torchdata loads;
a program that uses a name imports exactly what it imported before.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

__all__ = [
    "AmbiguousGraphError",
    "DataLoader",
    "MultiProcessingReadingService",
    "NoGraph",
    "PipelineStuckError",
    "Plan",
    "PlanError",
    "ProcessDiedError",
    "RayBackend",
    "Segment",
    "ServiceClosedError",
    "SharedList",
    "WorkerError",
    "plan",
]

_HOMES = {
    "AmbiguousGraphError": ".errors",
    "PipelineStuckError": ".errors",
    "PlanError": ".errors",
    "ProcessDiedError": ".errors",
    "ServiceClosedError": ".errors",
    "WorkerError": ".errors",
    "NoGraph": ".graph",
    "Plan": ".plan",
    "Segment": ".segment",
    "plan": ".plan",
    "MultiProcessingReadingService": ".reading_service",
    "RayBackend": ".backends.ray",
    "DataLoader": ".dataloader",
    "SharedList": ".shared_list",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'mprs_plus' has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """Keeps ``mprs_plus.plan`` the function: importing the submodule of the same name
    would otherwise set the package attribute to the module (the import system does so
    for every submodule), whichever way it was first imported."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "plan" and isinstance(value, types.ModuleType):
            return  # the submodule stays reachable as sys.modules["mprs_plus.plan"]
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


if TYPE_CHECKING:
    from .errors import (
        AmbiguousGraphError,
        PipelineStuckError,
        PlanError,
        ProcessDiedError,
        ServiceClosedError,
        WorkerError,
    )
    from .backends.ray import RayBackend
    from .graph import NoGraph
    from .plan import Plan, plan
    from .segment import Segment
    from .reading_service import MultiProcessingReadingService
    from .dataloader import DataLoader
    from .shared_list import SharedList
