"""Stream large tensors through the service where ``/dev/shm`` is tiny, as in a container.

    python small_shm_script.py CASES    prints {case: result} as one JSON line

Run it in a mount namespace whose ``/dev/shm`` is a small tmpfs (``test_small_shm.py``
does). CASES is JSON, a config per case name: pipe ("workers": the tensors are made in
the workers; "dispatch": made in the dispatch process, dealt out by a dispatcher, passed on
by the workers), n items of mib MiB each, workers, pin_memory (False is also
the service's default where it has no such option), full (fill ``/dev/shm`` to the last
page first, and empty it after). The cases run one after another in this one process.

A result says what arrived (every index, and the indices whose bytes were not what was
made), what ``/dev/shm`` looked like (its size, its free bytes at the start, how much more
of it was ever in use, and the names seen, read after every item; the names left after
the shutdown) and the warnings raised. A case
that raises reports {"error": its traceback}; one whose option the service does not have
reports {"unsupported": why}.
"""

from __future__ import annotations

import errno
import inspect
import json
import os
import sys
import traceback
import warnings
from typing import Any

import torch
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

import mprs_plus

SHM = "/dev/shm"
FILLER = os.path.join(SHM, "filler")  # what the "full" cases write first


def fill_of(index: int) -> int:
    return (index * 7 + 1) % 256  # distinct for the few dozen items of a case


def make(index: int, mib: int) -> tuple[int, torch.Tensor]:
    return index, torch.full((mib << 20,), fill_of(index), dtype=torch.uint8)


class Make:
    """``make`` with the size bound: a module-level callable, so any start method carries it."""

    def __init__(self, mib: int) -> None:
        self.mib = mib

    def __call__(self, index: int) -> tuple[int, torch.Tensor]:
        return make(index, self.mib)


def pass_on(item: tuple[int, torch.Tensor]) -> tuple[int, torch.Tensor, int]:
    index, tensor = item
    return index, tensor, os.getpid()  # the worker's work: the tensor goes on as it came


def build(config: dict[str, Any]) -> Any:
    source = IterableWrapper(range(config["n"]))
    if config["pipe"] == "workers":
        return source.sharding_filter().map(Make(config["mib"]))
    pipe = source.map(Make(config["mib"])).sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    return pipe.map(pass_on)


def shm_state() -> tuple[int, int, list[str]]:
    """Size and bytes in use of the ``/dev/shm`` file system, and the names in it."""
    st = os.statvfs(SHM)
    return st.f_blocks * st.f_frsize, (st.f_blocks - st.f_bfree) * st.f_frsize, sorted(os.listdir(SHM))


def fill_shm() -> None:
    """Fill ``/dev/shm`` to the last page, as other programs of a container may have."""
    fd = os.open(FILLER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for chunk in (bytes(1 << 20), bytes(4096)):
            try:
                while os.write(fd, chunk):
                    pass
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
    finally:
        os.close(fd)


def run_case(config: dict[str, Any]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if "pin_memory" in inspect.signature(mprs_plus.MultiProcessingReadingService).parameters:
        options["pin_memory"] = config["pin_memory"]
    elif config["pin_memory"]:
        return {"unsupported": "MultiProcessingReadingService has no pin_memory option yet"}
    if config.get("full"):
        fill_shm()
    size, baseline, _ = shm_state()
    peak = baseline
    seen: set[str] = set()
    arrived: list[int] = []
    damaged: list[int] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            service = mprs_plus.MultiProcessingReadingService(config["workers"], **options)
            loader = DataLoader2(build(config), reading_service=service)
            try:
                for item in loader:
                    index, tensor = item[0], item[1]
                    arrived.append(index)
                    if tensor.numel() != config["mib"] << 20 or not bool(tensor.eq(fill_of(index)).all()):
                        damaged.append(index)
                    del item, tensor  # the lent buffer goes back before the next item
                    _, used, names = shm_state()
                    peak = max(peak, used)
                    seen.update(names)
            finally:
                loader.shutdown()
        _, used, left = shm_state()
    finally:
        if config.get("full"):
            os.unlink(FILLER)
    return {
        "arrived": sorted(arrived),
        "damaged": damaged,
        "shm_size": size,
        "shm_free_at_start": size - baseline,
        "shm_grew": max(peak, used) - baseline,
        "shm_seen": sorted(seen - {os.path.basename(FILLER)}),
        "shm_left": sorted(set(left) - {os.path.basename(FILLER)}),
        "warnings": [str(w.message) for w in caught],
    }


def main(cases: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    results = {}
    for name, config in cases.items():
        try:
            results[name] = run_case(config)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    return results


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
