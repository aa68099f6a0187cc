"""What torchdata's own MultiProcessingReadingService yields for the test matrix's pipelines,
printed as JSON. Run in a process of its own by tests/test_matrix.py: torchdata's service
leaves threads and queues behind, which must not share a process with the tests that fork."""

from __future__ import annotations

import contextlib
import json
import sys
import warnings
from unittest import mock

import psutil
from torchdata.dataloader2 import DataLoader2, MultiProcessingReadingService
from torchdata.dataloader2 import reading_service as torchdata_reading_service
from torchdata.datapipes.map import SequenceWrapper

import pipelines

SEEDS = (3, 2**64 - 5)
N = 24
# torchdata's shutdown joins each of its processes for up to 20 s. With a dispatch process
# one of them misses its terminate request about one run in four (the join then waits the
# whole 20 s and the process stays); the items are read by then, so a reference waits a
# little, as a prompt exit takes milliseconds, and ends whatever is left itself.
JOIN_S = 2.0


def descendants() -> set[int]:
    """The ids of this process's descendants: taken before a torchdata loader is created,
    they tell its processes apart in ``shut_down``."""
    return {p.pid for p in psutil.Process().children(recursive=True)}


def shut_down(loader: DataLoader2, before: set[int]) -> None:
    """``loader.shutdown()`` of torchdata's service, bounded; any process of it (not in
    ``before``) that the shutdown left running is killed."""
    with mock.patch.object(torchdata_reading_service, "default_dl2_worker_join_timeout_in_s", JOIN_S):
        loader.shutdown()
    theirs = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    for process in theirs:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(theirs, timeout=10)


def epochs_with_seeds(datapipe, service=None):
    """Epochs with each seed of SEEDS, then one not reseeded; also used by test_matrix."""
    before = descendants()
    loader = DataLoader2(datapipe, reading_service=service or MultiProcessingReadingService(2))
    try:
        result = []
        for seed in SEEDS:
            loader.seed(seed)
            result.append(list(loader))
        result.append(list(loader))  # not reseeded: repeats the last epoch (see the test)
        return result
    finally:
        if service is None:
            shut_down(loader, before)
        else:
            loader.shutdown()


def main() -> None:
    warnings.simplefilter("ignore")
    result = {
        "no_dispatch": epochs_with_seeds(pipelines.matrix_pipe(N, dispatch=False)),
        "dispatch": epochs_with_seeds(pipelines.matrix_pipe(N, dispatch=True)),
        "map_datapipe": epochs_with_seeds(SequenceWrapper(range(5)).map(pipelines.double))[0],
    }
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
