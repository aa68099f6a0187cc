"""One rank of the distributed checkpoint test, run by tests/test_checkpoint.py as its own process.

    python distributed_checkpoint_script.py RANK WORLD_SIZE PORT FOLDER save|resume

Joins a gloo process group on 127.0.0.1:PORT and reads through
SequentialReadingService(DistributedReadingService(), MultiProcessingReadingService(2)).
``save``: 4 epochs with seed 5 (the reference), then a new loader with seed 5 reads 7 items
and writes its state_dict to FOLDER/stateRANK.pkl. ``resume``: a loader from that state (a
new process) reads 4 epochs: the rest of the interrupted one and 3 more. What was read goes
to FOLDER/RANK-ACTION.json.
"""

from __future__ import annotations

import json
import pickle
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from torchdata.dataloader2 import DataLoader2, DistributedReadingService, SequentialReadingService
from torchdata.datapipes.iter import IterableWrapper

from mprs_plus import MultiProcessingReadingService

TIMEOUT_S = 60
AT = 7


def triple(x: int) -> int:
    return 3 * x


def service() -> SequentialReadingService:
    return SequentialReadingService(
        DistributedReadingService(timeout=TIMEOUT_S),
        MultiProcessingReadingService(2, multiprocessing_context="fork", timeout=TIMEOUT_S),
    )


def new_loader() -> DataLoader2:
    pipe = IterableWrapper(range(40)).shuffle().sharding_filter().shuffle(buffer_size=4).map(triple)
    loader = DataLoader2(pipe, reading_service=service())
    loader.seed(5)
    return loader


def save(state_path: Path) -> dict:
    loader = new_loader()
    try:
        reference = [list(loader) for _ in range(4)]
    finally:
        loader.shutdown()
    loader = new_loader()
    try:
        iterator = iter(loader)
        got = [next(iterator) for _ in range(AT)]
        state = loader.state_dict()
    finally:
        loader.shutdown()
    state_path.write_bytes(pickle.dumps(state))
    return {"reference": reference, "got": got}


def resume(state_path: Path) -> dict:
    loader = DataLoader2.from_state(pickle.loads(state_path.read_bytes()), service())
    try:
        return {"epochs": [list(loader) for _ in range(4)]}
    finally:
        loader.shutdown()


def main() -> None:
    rank, world_size, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    folder, action = Path(sys.argv[4]), sys.argv[5]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    try:
        state_path = folder / f"state{rank}.pkl"
        result = save(state_path) if action == "save" else resume(state_path)
    finally:
        dist.destroy_process_group()
    (folder / f"{rank}-{action}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
