"""4 MiB torch tensors made in the workers, in GB/s delivered to the main process.

A fresh 4 MiB tensor lives outside the allocator's cache, so making one costs page faults
as well as the fill: the work is real, and workers making tensors in parallel should beat
making them in the main process, provided that moving them costs less than making them.
"""

from __future__ import annotations

import functools

from .. import harness
from ._shared import mapped_range_runners, spdl_pool, torch_tensor

NUMEL = harness.MiB  # float32: 4 MiB
NBYTES = 4 * NUMEL

WORKLOAD = harness.Workload(
    name="torch_tensors",
    title="4 MiB torch tensors",
    description="torch.full of 1 Mi float32 (4 MiB) made in the workers; GB/s received by the main process",
    metrics=(harness.Metric("throughput", "GB/s"), harness.MAIN_CPU),
    runners=mapped_range_runners(
        items=lambda s: 64 if s.quick else 1024,
        make_fn=lambda s: functools.partial(torch_tensor, numel=NUMEL),
        item_bytes=NBYTES,
        spdl_pool=spdl_pool(NBYTES),
    ),
    targets=(
        harness.Target("throughput", harness.IN_PROCESS, 1.2),
        harness.Target("throughput", harness.TORCH, 4.0),
        harness.Target("main_cpu_gbps", harness.MEMCPY, 20.0),
        harness.Target("throughput", harness.TORCHDATA, 4.0),
    ),
    notes={harness.SPDL: "SharedMemorySegmentPool of 8 x 4 MiB; tensors arrive as torch tensors viewing shared memory"},
)
