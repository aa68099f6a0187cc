"""1 MiB numpy arrays made in the workers, in GB/s delivered to the main process.

Making an array costs little (a fill of memory that is still in cache), so this is the
bandwidth of the transport itself; the single-core memcpy bandwidth is its physical limit.
"""

from __future__ import annotations

import functools

from .. import harness
from ._shared import mapped_range_runners, spdl_pool, numpy_array

NBYTES = harness.MiB

WORKLOAD = harness.Workload(
    name="numpy_arrays",
    title="1 MiB numpy arrays",
    description="np.full of 1 MiB (uint8) made in the workers; GB/s received by the main process",
    metrics=(harness.Metric("throughput", "GB/s"), harness.MAIN_CPU),
    runners=mapped_range_runners(
        items=lambda s: 256 if s.quick else 4096,
        make_fn=lambda s: functools.partial(numpy_array, nbytes=NBYTES),
        item_bytes=NBYTES,
        spdl_pool=spdl_pool(NBYTES),
    ),
    targets=(
        harness.Target("throughput", harness.MEMCPY, 0.6),
        harness.Target("main_cpu_gbps", harness.MEMCPY, 20.0),
        harness.Target("throughput", harness.TORCHDATA, 10.0),
        # SPDL's zero-copy pool: the fastest way we know to move arrays out of one process.
        harness.Target("throughput", harness.SPDL, 1.0),
    ),
    notes={
        harness.TORCH: "DataLoader converts the arrays to tensors (batch_size=None)",
        harness.SPDL: "SharedMemorySegmentPool of 8 x 1 MiB; arrays arrive as views of shared memory",
    },
)
