"""What torchdata's own MultiProcessingReadingService yields for the test matrix's pipelines,
printed as JSON. Run in a process of its own by tests/test_matrix.py: torchdata's service
leaves threads and queues behind, which must not share a process with the tests that fork."""

from __future__ import annotations

import json
import sys
import warnings

from torchdata.dataloader2 import DataLoader2, MultiProcessingReadingService
from torchdata.datapipes.map import SequenceWrapper

import pipelines

SEEDS = (3, 2**64 - 5)
N = 24


def epochs_with_seeds(datapipe, service=None):
    """Epochs with each seed of SEEDS, then one not reseeded; also used by test_matrix."""
    loader = DataLoader2(datapipe, reading_service=service or MultiProcessingReadingService(2))
    try:
        result = []
        for seed in SEEDS:
            loader.seed(seed)
            result.append(list(loader))
        result.append(list(loader))  # not reseeded: repeats the last epoch (see the test)
        return result
    finally:
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
