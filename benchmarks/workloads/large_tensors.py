"""64 MiB torch tensors made in the workers, in GB/s delivered to the main process.

The size of a batch of images (256 images of 3x224x224 in float32 is 147 MiB; 64 MiB is a
modest batch). Items this large are bigger than any channel's ring, so they show what a
loader does with data it cannot buffer: torch's DataLoader hands shared-memory storage
over without copying it, while a copying transport pays for every byte in the one main
process. The main-process CPU figure shows that cost independently of the core count.
"""

from __future__ import annotations

import functools

from .. import harness
from ._shared import mapped_range_runners, spdl_pool, torch_tensor

NUMEL = 16 * harness.MiB  # float32: 64 MiB
NBYTES = 4 * NUMEL

WORKLOAD = harness.Workload(
    name="large_tensors",
    title="64 MiB torch tensors",
    description="torch.full of 16 Mi float32 (64 MiB, a batch of images) made in the workers; GB/s received by the main process",
    metrics=(harness.Metric("throughput", "GB/s"), harness.MAIN_CPU),
    runners=mapped_range_runners(
        items=lambda s: 6 if s.quick else 96,
        make_fn=lambda s: functools.partial(torch_tensor, numel=NUMEL),
        item_bytes=NBYTES,
        spdl_pool=spdl_pool(NBYTES),
    ),
    targets=(
        harness.Target("throughput", harness.TORCH, 1.5),
        harness.Target("main_cpu_gbps", harness.MEMCPY, 20.0),
    ),
    notes={harness.SPDL: "SharedMemorySegmentPool of 8 x 64 MiB (512 MiB of shared memory); tensors arrive as views"},
)
