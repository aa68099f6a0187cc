"""Imbalanced per-item costs: what reading items as they are ready (``in_order=False``) gains
over the default deterministic round-robin.

The workload: ``num_items`` items, dealt round-robin to ``num_workers`` workers by
``sharding_filter``. The items come in stretches of ``block``; within a stretch, the items
of one worker cost ``slow_ms`` each and everybody else's cost nothing, and the slow worker
changes from one stretch to the next. Every item carries ``payload_bytes`` of data, so
that a worker's channel holds only a few items (as with real samples)::

    stretch 0: worker 0 slow, worker 1 fast | stretch 1: worker 1 slow, ... | ...

In order, the main process takes one item from each worker in turn, so during a stretch it
waits for the slow worker while the fast ones fill their channels and stop: about one
worker is busy at a time. As ready, the main process takes whatever arrives, so the fast
workers run on into their own slow stretch: all workers stay busy. With ``num_workers``
workers the ideal gain is about ``num_workers`` x.

The cost is a sleep: it stands for per-item latency (I/O, a remote fetch, an uneven decode
in native code) and leaves the CPUs to the processes that move the data.

``measure(...)`` returns a dict (items per second for both modes, their ratio, and the
configuration). Standalone, with the package importable (installed, or ``PYTHONPATH=.``
from the repository root)::

    python benchmarks/workloads/imbalanced.py [--workers 2] [--items 800] [--block 200]
        [--slow-ms 2] [--payload 16384] [--epochs 2] [--start-method fork]
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from mprs_plus import MultiProcessingReadingService


def costly(index: int, num_workers: int, block: int, slow_s: float, payload_bytes: int) -> tuple[int, bytes]:
    """Item ``index`` as a worker makes it: slow when its worker is the slow one of its stretch."""
    if index % num_workers == (index // block) % num_workers:
        time.sleep(slow_s)
    return index, bytes(payload_bytes)


def make_pipe(num_items: int, num_workers: int, block: int, slow_ms: float, payload_bytes: int) -> Any:
    cost = functools.partial(
        costly, num_workers=num_workers, block=block, slow_s=slow_ms / 1000.0, payload_bytes=payload_bytes
    )
    return IterableWrapper(range(num_items)).sharding_filter().map(cost)


def _rate(in_order: bool, epochs: int, num_items: int, num_workers: int, start_method: str | None, **pipe: Any) -> float:
    service = MultiProcessingReadingService(num_workers, multiprocessing_context=start_method, in_order=in_order)
    loader = DataLoader2(make_pipe(num_items, num_workers, **pipe), reading_service=service)
    try:
        seen = sum(1 for _ in loader)  # warm-up: starts the processes, untimed
        if seen != num_items:
            raise RuntimeError(f"expected {num_items} items, read {seen}")
        start = time.perf_counter()
        count = sum(1 for _ in range(epochs) for _ in loader)
        elapsed = time.perf_counter() - start
    finally:
        loader.shutdown()
    if count != epochs * num_items:
        raise RuntimeError(f"expected {epochs * num_items} items, read {count}")
    return count / elapsed


def measure(
    num_workers: int = 2,
    num_items: int = 800,
    block: int = 200,
    slow_ms: float = 2.0,
    payload_bytes: int = 16384,
    epochs: int = 2,
    start_method: str | None = None,
) -> dict[str, Any]:
    """Items per second in order and as ready, on the workload described above.

    Returns ``{"ordered": float, "unordered": float, "speedup": unordered / ordered,
    "config": {...the arguments...}}``. Each mode gets its own service; one untimed epoch
    starts the processes, then ``epochs`` epochs are timed.
    """
    pipe = {"block": block, "slow_ms": slow_ms, "payload_bytes": payload_bytes}
    ordered = _rate(True, epochs, num_items, num_workers, start_method, **pipe)
    unordered = _rate(False, epochs, num_items, num_workers, start_method, **pipe)
    config = {"num_workers": num_workers, "num_items": num_items, "epochs": epochs, "start_method": start_method, **pipe}
    return {"ordered": ordered, "unordered": unordered, "speedup": unordered / ordered, "config": config}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--items", type=int, default=800)
    parser.add_argument("--block", type=int, default=200)
    parser.add_argument("--slow-ms", type=float, default=2.0)
    parser.add_argument("--payload", type=int, default=16384)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--start-method", default=None)
    args = parser.parse_args()
    result = measure(args.workers, args.items, args.block, args.slow_ms, args.payload, args.epochs, args.start_method)
    print(f"imbalanced workload: {result['config']}")
    print(f"  in order (round-robin): {result['ordered']:10.1f} items/s")
    print(f"  as ready (in_order=False): {result['unordered']:7.1f} items/s")
    print(f"  gain: {result['speedup']:.2f}x")


if __name__ == "__main__":
    main()
