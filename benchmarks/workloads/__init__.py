"""The workloads, one module each, in the order the report shows them.

Each module defines ``WORKLOAD``, a ``harness.Workload``: what it measures, a runner per
contender it applies to, and the project's targets for it.
"""

from __future__ import annotations

from ..harness import Workload
from . import (
    cold_start,
    cpu_bound,
    dispatch_pipeline,
    large_tensors,
    memory_growth,
    numpy_arrays,
    seed_wrapper,
    startup_shutdown,
    tiny_items,
    torch_tensors,
)

WORKLOADS: tuple[Workload, ...] = (
    tiny_items.WORKLOAD,
    numpy_arrays.WORKLOAD,
    torch_tensors.WORKLOAD,
    large_tensors.WORKLOAD,
    cpu_bound.WORKLOAD,
    dispatch_pipeline.WORKLOAD,
    seed_wrapper.WORKLOAD,
    startup_shutdown.WORKLOAD,
    cold_start.WORKLOAD,
    memory_growth.WORKLOAD,
)
