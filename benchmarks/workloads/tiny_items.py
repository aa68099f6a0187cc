"""Tiny items: ints through an identity map, in items/s.

Nothing to compute, nothing to copy: what is left is the per-item cost of moving an
item from a worker to the main process (messages, wake-ups, pickling).
"""

from __future__ import annotations

from .. import harness
from ._shared import identity, mapped_range_runners

WORKLOAD = harness.Workload(
    name="tiny_items",
    title="tiny items",
    description="ints 0..n through an identity map in the workers; per-item transport overhead, items/s",
    metrics=(harness.Metric("throughput", "items/s"),),
    runners=mapped_range_runners(
        items=lambda s: 50_000 if s.quick else 1_000_000,
        make_fn=lambda s: identity,
    ),
    targets=(
        harness.Target("throughput", harness.TORCHDATA, 30.0),
        harness.Target("throughput", harness.TORCH, 10.0),
    ),
    # An int has nothing for the pool to carry, and each item would still take a segment
    # and a reclaim: SPDL runs it through its queue alone, its faster way for small items.
    notes={harness.SPDL: "no arena (ints have nothing to offload): SPDL's pickled queue"},
)
