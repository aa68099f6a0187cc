"""What one item costs the main process's CPU at the least, on this machine.

    python benchmarks/main_cpu_floor.py [--quick]

The suite's "main CPU" rows divide the main process's CPU time by the items it received.
This script takes that figure apart, to tell what the transport costs from what the
machine charges any consumer that wakes up once per item. Two producer processes (as the
suite's two workers) send to the consumer in this process, which reads their channels in
turn with bare ``recv()`` calls: no loader layers. Cases:

    tiny, producers idle         an int per message; the producers sleep between messages,
                                 so that the consumer waits for each, as in the suite
    tiny, producers streaming    an int per message; between messages each producer copies
                                 8 MiB (what making a 4 MiB tensor and lending it costs),
                                 or 64 MiB (a 64 MiB tensor's): more than this machine's
                                 last-level cache, so the consumer wakes up to cold caches
    4 MiB tensor, streaming      a fresh torch.full lent to the consumer (the suite's row
                                 without its loader layers)
    4 MiB tensor, from full rings
                                 the same, read in bursts from rings the producers filled
                                 and then sleep on: no producer runs while the consumer reads
    in-process unpickling        pickle.loads of the same message, buffers ready, in a loop
    DataLoader2 + mprs_plus      the suite's 4 MiB row, every layer
      ..., 1 ms step             the same with a training step between items: only next()
                                 is timed, and it runs with the caches the step left
    DataLoader2 in-process       torchdata's own layers over tensors made beforehand, two
                                 neighbours sweeping memory as the workers do; hot, and
      ..., 1 ms step             with the step: what cold caches alone cost torchdata

Each figure is main-process CPU per item (``time.process_time``), next to the suite's
target for 4 MiB items: 5 % of the time one core takes to copy 4 MiB, with the suite's
memcpy probe (copies too large for any cache).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pickle
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Run from a checkout without installing: the package sits next to this folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import mprs_plus.runtime  # noqa: E402,F401  (registers the tensor reducer)
from mprs_plus.transport import EndOfStream, open_channel, release_all_except  # noqa: E402
from mprs_plus.transport._lend import lent_ahead  # noqa: E402
from mprs_plus.transport.serialize import Encoder  # noqa: E402

from benchmarks.harness import GB, memcpy_bandwidth  # noqa: E402

CTX = multiprocessing.get_context("fork")
MIB = 1 << 20
PRODUCERS = 2
IDLE_PERIOD_S = 400e-6  # two producers at this pace: one message per 200 us, as in the suite


def _tiny_idle(i: int) -> Any:
    time.sleep(IDLE_PERIOD_S)  # pacing the producer, not synchronisation
    return i


class _Streaming:
    """Copies ``2 * half`` bytes before each message: with 4 MiB halves, the memory traffic
    of a worker making and lending a 4 MiB tensor, without sending it."""

    def __init__(self, half: int = 4 * MIB) -> None:
        self.source = np.ones(half, dtype=np.uint8)
        self.target = np.empty(half, dtype=np.uint8)

    def __call__(self, i: int) -> Any:
        self.target[:] = self.source
        self.source[:] = self.target
        return i


def _tensor(i: int) -> Any:
    return torch.full((MIB,), float(i))


# 4 MiB tensors a channel holds unread, at most: its lent bytes in flight are bounded
# (``lent_ahead``), below its 10 messages; a burst waits for that many.
_FULL = min(8, lent_ahead(64 * MIB, 4 * MIB) // (4 * MIB))


def _produce(sender: Any, make: Callable[[int], Any], count: int) -> None:
    release_all_except([sender])
    torch.set_num_threads(1)
    for i in range(count):
        sender.send((10, 1, [make(i)]))  # the runtime's ITEMS message: (kind, epoch, items)
    sender.close()


def read_channels(make: Callable[[int], Any], count: int, burst: int = 0) -> float:
    """Main-process CPU seconds per message over ``count`` messages from each producer.
    With ``burst``, the consumer lets the rings fill (and the producers block) before it
    reads ``burst`` messages of each, and only those reads are timed."""
    ends = [open_channel(CTX, capacity_items=10, capacity_bytes=64 * MIB) for _ in range(PRODUCERS)]
    producers = [CTX.Process(target=_produce, args=(tx, make, count)) for tx, _ in ends]
    for producer in producers:
        producer.start()
    receivers = []
    for (tx, rx), producer in zip(ends, producers):
        tx.release()
        rx.watch(producer.sentinel)
        receivers.append(rx)
    warm = count // 10
    cpu = 0.0
    timed = 0
    try:
        for _ in range(warm):
            for rx in receivers:
                rx.recv()
        left = count - warm
        while left > 0:
            if burst:
                _wait_until_full(receivers, min(burst, left))
            rounds = min(burst, left) if burst else left
            start = time.process_time()
            for _ in range(rounds):
                for rx in receivers:
                    item = rx.recv()
                    del item
            cpu += time.process_time() - start
            timed += rounds * len(receivers)
            left -= rounds
        for rx in receivers:
            try:
                rx.recv()
            except EndOfStream:
                pass
    finally:
        for producer in producers:
            producer.join(timeout=30)
            if producer.is_alive():
                producer.kill()
                producer.join()
        for rx in receivers:
            rx.close()
    return cpu / timed


def _wait_until_full(receivers: list[Any], messages: int) -> None:
    """Until every ring holds ``messages`` messages: what the consumer waits for is the
    producers' progress, polled at 1 ms (this is measurement set-up, not a data path)."""
    deadline = time.monotonic() + 30
    while any(rx.traffic().queued_messages < messages for rx in receivers):
        if time.monotonic() > deadline:
            raise RuntimeError("the producers did not fill their rings within 30 s")
        time.sleep(0.001)


def unpickle_in_process(count: int) -> float:
    """pickle.loads of one 4 MiB tensor message with its buffer ready: the floor of
    turning a frame into a tensor, with warm caches and no other process running."""
    encoder = Encoder()
    stream, buffers = encoder.encode((10, 1, [torch.full((MIB,), 1.0)]))
    stream = bytes(stream)
    ready = [np.frombuffer(bytearray(b), dtype=np.uint8) for b in buffers]
    encoder.release()
    start = time.process_time()
    for _ in range(count):
        item = pickle.loads(stream, buffers=ready)
        del item
    return (time.process_time() - start) / count


def full_loader(count: int) -> float:
    """The suite's 4 MiB row through DataLoader2 and every layer of the service."""
    total = PRODUCERS * count
    loader = _service_loader(total)
    warm = total // 10
    seen = 0
    start = 0.0
    try:
        for item in loader:
            del item
            seen += 1
            if seen == warm:
                start = time.process_time()
        cpu = time.process_time() - start
    finally:
        loader.shutdown()
    return cpu / (total - warm)


def _torchdata() -> tuple[Any, Any]:
    """torchdata's ``DataLoader2`` and ``IterableWrapper``, without its deprecation warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchdata.dataloader2 import DataLoader2
        from torchdata.datapipes.iter import IterableWrapper
    return DataLoader2, IterableWrapper


def _service_loader(count: int) -> Any:
    """The suite's 4 MiB row: ``count`` tensors made by ``PRODUCERS`` workers."""
    from mprs_plus import MultiProcessingReadingService

    DataLoader2, IterableWrapper = _torchdata()
    pipe = IterableWrapper(range(count)).sharding_filter().map(_tensor)
    return DataLoader2(pipe, reading_service=MultiProcessingReadingService(num_workers=PRODUCERS))


STEP_S = 1e-3  # the "training step" between two items: the main process is elsewhere


def cpu_per_next(iterator: Any, count: int, step: bool) -> float:
    """Main-process CPU per ``next()`` alone, over ``count`` items after a tenth of them
    as warm-up; with ``step``, the consumer sleeps ``STEP_S`` between items, as a training
    loop is busy between them, so the loader's code runs with the caches others left."""
    clock = time.thread_time
    overhead = min(-clock() + clock() for _ in range(1000))  # the two clock reads around each next()
    warm = count // 10
    cpu = 0.0
    for seen in range(count):
        start = clock()
        item = next(iterator)
        spent = clock() - start
        del item
        if seen >= warm:
            cpu += spent - overhead
        if step:
            time.sleep(STEP_S)  # the training step (a workload, not a synchronisation)
    return cpu / (count - warm)


def _sweep() -> None:
    """A neighbour that copies 8 MiB over and over, as a worker making 4 MiB tensors does."""
    copy = _Streaming()
    while True:
        copy(0)


def in_process_loader(count: int, step: bool) -> float:
    """DataLoader2 with no reading service over tensors made beforehand, while
    ``PRODUCERS`` neighbours sweep memory as the workers would: what torchdata's own
    per-item layers cost the main process, hot (no step) or with cold caches (step)."""
    DataLoader2, IterableWrapper = _torchdata()
    ready = [_tensor(i) for i in range(8)]
    loader = DataLoader2(IterableWrapper([ready[i % 8] for i in range(count)]))
    neighbours = [CTX.Process(target=_sweep, daemon=True) for _ in range(PRODUCERS)]
    for neighbour in neighbours:
        neighbour.start()
    try:
        return cpu_per_next(iter(loader), count, step)
    finally:
        for neighbour in neighbours:
            neighbour.kill()
            neighbour.join()
        loader.shutdown()


def stepped_loader(count: int) -> float:
    """The suite's 4 MiB row through every layer, with a training step between items."""
    loader = _service_loader(count)
    try:
        return cpu_per_next(iter(loader), count, step=True)
    finally:
        loader.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer messages (about 15 s in all)")
    parser.add_argument("--runs", type=int, default=3, help="runs per case, the median reported (default 3)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    scale = 1 if args.quick else 4
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} cpus, "
        f"load {os.getloadavg()[0]:.2f}"
    )
    gbps = memcpy_bandwidth(256 * MIB, 5)  # the suite's probe: copies too large to stay in a cache
    target = 0.05 * 4 * MIB / (gbps * GB)
    print(f"memcpy, one core: {gbps:.1f} GB/s; the target per 4 MiB item (5 % of a copy): {target * 1e6:.1f} us")
    cases: list[tuple[str, Callable[[], float]]] = [
        ("tiny, producers idle", lambda: read_channels(_tiny_idle, 500 * scale)),
        ("tiny, producers streaming 8 MiB", lambda: read_channels(_Streaming(), 500 * scale)),
        ("tiny, producers streaming 64 MiB", lambda: read_channels(_Streaming(32 * MIB), 100 * scale)),
        ("4 MiB tensor, streaming", lambda: read_channels(_tensor, 500 * scale)),
        ("4 MiB tensor, from full rings", lambda: read_channels(_tensor, 250 * scale, burst=_FULL)),
        ("in-process unpickling", lambda: unpickle_in_process(20_000 * scale)),
        ("DataLoader2 + mprs_plus", lambda: full_loader(500 * scale)),
        ("DataLoader2 + mprs_plus, 1 ms step", lambda: stepped_loader(300 * scale)),
        ("DataLoader2 in-process", lambda: in_process_loader(2000 * scale, step=False)),
        ("DataLoader2 in-process, 1 ms step", lambda: in_process_loader(300 * scale, step=True)),
    ]
    for name, run in cases:
        figures = sorted(run() for _ in range(args.runs))
        per_item = figures[len(figures) // 2]
        print(f"{name:<36}{per_item * 1e6:>8.1f} us per item   {per_item / target:5.1f}x the target")


if __name__ == "__main__":
    main()
