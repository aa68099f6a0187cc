"""Micro-benchmark of the transport: one producer process, the consumer in this one.

    python benchmarks/transport_micro.py [--quick]

Cases (fork start method; medians of 3 runs):
    ints        one small int per message                          -> messages/s
    numpy 1MiB  a fresh np.full array per message                  -> GB/s
    torch 4MiB  a fresh torch.full tensor per message              -> GB/s
each through an mprs_plus channel (64 MiB, 10 items: the runtime's data channel) and
through multiprocessing.Queue (for tensors that is torch's own sharing: each tensor is
moved to a shared-memory file whose descriptor travels), next to a single-core memcpy of
64 MiB for scale.
Timing starts when the first message arrives, so process start-up is not counted.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Run from a checkout without installing: the package sits next to this folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import mprs_plus.runtime  # noqa: E402,F401  (registers the tensor reducer)
from mprs_plus.transport import EndOfStream, open_channel, release_all_except  # noqa: E402

CTX = multiprocessing.get_context("fork")
MIB = 1 << 20


def make_ints(count: int) -> Callable[[int], Any]:
    return lambda i: i


def make_numpy(count: int) -> Callable[[int], Any]:
    return lambda i: np.full(MIB // 8, i, dtype=np.float64)


def make_torch(count: int) -> Callable[[int], Any]:
    return lambda i: torch.full((MIB,), i, dtype=torch.float32)


CASES: dict[str, tuple[Callable[[int], Callable[[int], Any]], int, int]] = {
    # name: (factory, bytes per message, messages in --quick / full mode is 4x)
    "ints": (make_ints, 0, 100_000),
    "numpy 1MiB": (make_numpy, MIB, 300),
    "torch 4MiB": (make_torch, 4 * MIB, 100),
}


def _produce_channel(sender: Any, receiver: Any, name: str, count: int) -> None:
    release_all_except([sender])
    make = CASES[name][0](count)
    for i in range(count):
        sender.send(make(i))
    sender.close()


def run_channel(name: str, count: int) -> float:
    torch.set_num_threads(1)
    sender, receiver = open_channel(CTX, capacity_items=10, capacity_bytes=64 * MIB)
    producer = CTX.Process(target=_produce_channel, args=(sender, receiver, name, count))
    producer.start()
    sender.release()
    receiver.watch(producer.sentinel)
    receiver.recv()
    start = time.perf_counter()
    received = 1
    try:
        while True:
            receiver.recv()
            received += 1
    except EndOfStream:
        pass
    elapsed = time.perf_counter() - start
    producer.join()
    receiver.close()
    assert received == count, (received, count)
    return elapsed


def _produce_queue(queue: Any, done: Any, name: str, count: int) -> None:
    make = CASES[name][0](count)
    for i in range(count):
        queue.put(make(i))
    queue.put(None)
    queue.close()
    queue.join_thread()
    # torch moves queued tensors to shared memory and hands out their descriptors from
    # this process: it must outlive the last get().
    done.wait()


def run_queue(name: str, count: int) -> float:
    queue = CTX.Queue(maxsize=10)
    done = CTX.Event()
    producer = CTX.Process(target=_produce_queue, args=(queue, done, name, count))
    producer.start()
    queue.get()
    start = time.perf_counter()
    received = 1
    while queue.get() is not None:
        received += 1
    elapsed = time.perf_counter() - start
    done.set()
    producer.join()
    assert received == count, (received, count)
    return elapsed


def memcpy_gbps() -> float:
    source = np.ones(64 * MIB, dtype=np.uint8)
    target = np.empty_like(source)
    target[:] = source  # fault the pages in first
    start = time.perf_counter()
    target[:] = source
    return 64 * MIB / (time.perf_counter() - start) / 1e9


def median_of_3(run: Callable[[], float]) -> float:
    return statistics.median(run() for _ in range(3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer messages per run (about 10 s in all)")
    args = parser.parse_args()
    scale = 1 if args.quick else 4
    print(f"python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}, "
          f"{os.cpu_count()} cpus, {platform.machine()}, load {os.getloadavg()[0]:.2f}")
    memcpy = median_of_3(memcpy_gbps)
    print(f"{'memcpy 64MiB, one core':<24}{memcpy:>10.2f} GB/s")
    for name, (_, size, quick_count) in CASES.items():
        count = quick_count * scale
        ours = count / median_of_3(lambda: run_channel(name, count))
        theirs = count / median_of_3(lambda: run_queue(name, count))
        if size:
            gb_ours, gb_theirs = ours * size / 1e9, theirs * size / 1e9
            print(f"{name:<24}{gb_ours:>10.2f} GB/s   mp.Queue {gb_theirs:6.2f} GB/s   "
                  f"x{gb_ours / gb_theirs:.1f} vs Queue, {gb_ours / memcpy:.2f} of memcpy")
        else:
            print(f"{name:<24}{ours / 1e3:>10.0f} k msgs/s   mp.Queue {theirs / 1e3:6.0f} k msgs/s   "
                  f"x{ours / theirs:.1f} vs Queue")


if __name__ == "__main__":
    main()
