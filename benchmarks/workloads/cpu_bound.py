"""About 2 ms of pure-Python CPU work per item, in items/s.

The work holds the GIL, so only processes run it in parallel: with N workers on N free
cores the ceiling is N times in-process.
"""

from __future__ import annotations

import functools

from .. import harness
from ._shared import burn, mapped_range_runners

WORKLOAD = harness.Workload(
    name="cpu_bound",
    title="2 ms CPU work",
    description="a pure-Python loop of about 2 ms per item in the workers (GIL held); items/s",
    metrics=(harness.Metric("throughput", "items/s"),),
    runners=mapped_range_runners(
        items=lambda s: 100 if s.quick else 1500,
        make_fn=lambda s: functools.partial(burn, loops=s.cpu_loops),
    ),
    targets=(harness.Target("throughput", harness.IN_PROCESS, 1.8),),
    notes={harness.SPDL: "no arena (ints); one process does all the work, so no parallel speed-up"},
)
