"""Run by test_numpy_seeding.py in a fresh interpreter, whose main process never loads
numpy.random: the values a pipeline draws from numpy's global generator in its workers,
with mprs_plus and then with torchdata's reading service, as one JSON line."""

from __future__ import annotations

import json
import sys

from torchdata.dataloader2 import DataLoader2
from torchdata.dataloader2 import MultiProcessingReadingService as TorchdataService
from torchdata.datapipes.iter import IterableWrapper

from mprs_plus import MultiProcessingReadingService

ITEMS = 6  # three per worker and epoch
_calls = 0


def draw_from_first_item(x: int) -> tuple[int, bool, int]:
    """(item, was numpy.random loaded in this worker before, a draw from the global generator)"""
    loaded = "numpy.random" in sys.modules
    import numpy.random

    hooks = [f for f in sys.meta_path if type(f).__module__.startswith("mprs_plus")]
    assert not hooks, f"still on sys.meta_path after numpy.random loaded: {hooks}"
    return x, loaded, int(numpy.random.randint(1 << 30))


def draw_in_second_epoch(x: int) -> tuple[int, bool, int]:
    """Nothing drawn (numpy.random not loaded) until this worker's second epoch."""
    global _calls
    _calls += 1
    if _calls <= ITEMS // 2:
        return x, False, -1
    return draw_from_first_item(x)


def epochs(service_type: type, fn, seeds: tuple[int, ...]) -> list[list[list]]:
    pipe = IterableWrapper(range(ITEMS)).sharding_filter().map(fn)
    loader = DataLoader2(pipe, reading_service=service_type(num_workers=2, multiprocessing_context="fork"))
    try:
        found = []
        for seed in seeds:
            loader.seed(seed)
            found.append(sorted(loader))
        return found
    finally:
        loader.shutdown()


if __name__ == "__main__":
    cases = {"first_item": (draw_from_first_item, (7, 8)), "second_epoch": (draw_in_second_epoch, (7, 8))}
    report = {}
    for name, (fn, seeds) in cases.items():
        ours = epochs(MultiProcessingReadingService, fn, seeds)
        report[name] = {"mprs_plus": ours, "torchdata": epochs(TorchdataService, fn, seeds)}
    report["main_loaded_numpy_random"] = "numpy.random" in sys.modules
    print(json.dumps(report))
