"""One rank of the distributed test, run by tests/test_distributed.py as its own process.

    python distributed_script.py RANK WORLD_SIZE PORT OUTPUT_JSON

Joins a gloo process group on 127.0.0.1:PORT and, for each case, reads two epochs through
SequentialReadingService(DistributedReadingService(), MultiProcessingReadingService(2)),
with torchdata's multiprocessing service and with ours, and writes what it read as JSON.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch.distributed as dist
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2 import DataLoader2, DistributedReadingService, SequentialReadingService
from torchdata.dataloader2 import MultiProcessingReadingService as TorchdataService
from torchdata.datapipes.iter import IterableWrapper

from mprs_plus import MultiProcessingReadingService
from torchdata_reference import descendants, shut_down

TIMEOUT_S = 60


def double(x):
    return 2 * x


def pipe(case: str):
    n = 21 if case == "uneven" else 40
    pipe = IterableWrapper(range(n)).shuffle().sharding_filter()  # split between ranks (and workers)
    if case == "dispatch":
        pipe = pipe.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    return pipe.map(double)


def read(case: str, service_class) -> list[list[int]]:
    before = descendants()
    service = SequentialReadingService(DistributedReadingService(timeout=TIMEOUT_S), service_class(2))
    loader = DataLoader2(pipe(case), reading_service=service)
    loader.seed(123)
    try:
        return [list(loader) for _ in range(2)]
    finally:
        if service_class is TorchdataService:
            shut_down(loader, before)  # bounded: torchdata's own may wait 20 s (torchdata_reference)
        else:
            loader.shutdown()


def main() -> None:
    rank, world_size, port, output = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    try:
        result = {
            case: {"torchdata": read(case, TorchdataService), "ours": read(case, MultiProcessingReadingService)}
            for case in ("sharded", "dispatch", "uneven")
        }
    finally:
        dist.destroy_process_group()
    with open(output, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
