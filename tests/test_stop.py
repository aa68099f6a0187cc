"""Stopping cannot block, cannot stop half-way, and reaches users only as ServiceClosedError.

Each case fails a service whose stop sends on a full control channel, unpickles what it
drains, lets a transport error out of a read after a stop, or keeps its processes until a
garbage collection. The autouse leak check (conftest) also fails any process left behind.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import signal
import threading
import time

import psutil
import pytest
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

import pipelines
from mprs_plus import MultiProcessingReadingService, ServiceClosedError
from mprs_plus.runtime.main.lifecycle import STOP_GRACE


def loader_for(pipe, **options):
    options.setdefault("num_workers", 2)
    return DataLoader2(pipe, reading_service=MultiProcessingReadingService(**options))


def children_since(before: set[int]) -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in before]


def alive(processes: list[psutil.Process]) -> list[int]:
    found = []
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                found.append(process.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def freeze(process: psutil.Process) -> None:
    """SIGSTOP ``process`` and return once the kernel shows it stopped: from then on it
    reads nothing, so what is sent to it stays in its channels."""
    os.kill(process.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while process.status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, "the process did not stop"
        time.sleep(0.001)


def kill_all(processes):
    """Clean-up after a test that froze a child: end whatever is left of them."""
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def slow(item):
    return pipelines.spin(item, 0.0005)


def test_shutdown_returns_within_the_grace_period_when_a_stopped_worker_has_a_full_control_channel():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    loader = loader_for(pipelines.sharded_pipe(1000))
    iterator = iter(loader)
    next(iterator)
    workers = children_since(before)
    assert len(workers) == 2
    freeze(workers[0])  # alive, but reads nothing any more
    try:
        for _ in range(4):  # fills its control channel
            loader.reading_service._pause()
        done = threading.Event()
        stopper = threading.Thread(target=lambda: (loader.shutdown(), done.set()), daemon=True)
        started = time.monotonic()
        stopper.start()
        done.wait(STOP_GRACE + 10)
        took = time.monotonic() - started
        # Bounded, not timed: blocked on the frozen worker's full channel, it never returns.
        assert done.is_set(), f"shutdown() blocked on the stopped worker ({took:.0f} s)"
        assert alive(workers) == []
    finally:
        kill_all(workers)


def test_an_item_that_fails_to_unpickle_in_main_reaches_the_user_and_the_stop_completes():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    bad = functools.partial(pipelines.unloadable_in_main, main_pid=os.getpid())
    loader = loader_for(IterableWrapper(range(400)).sharding_filter().map(bad))
    with pytest.raises(pipelines.RebuildError, match="cannot be rebuilt in the main process"):
        list(loader)  # DataLoader2 shuts the service down on this error
    assert alive(children_since(before)) == []
    loader.shutdown()  # again: nothing left to do, and no error


def _iterate_while_another_thread_shuts_down(pipe) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    loader = loader_for(pipe)
    shutting = threading.Event()
    stopper = threading.Thread(target=lambda: (shutting.wait(10), loader.shutdown()), daemon=True)
    stopper.start()
    try:
        for count, _ in enumerate(loader):
            if count == 3:
                shutting.set()  # the stop now races with the reads below
    except ServiceClosedError:
        pass  # the only error a user may see; anything else fails the test
    finally:
        shutting.set()
        stopper.join(STOP_GRACE + 10)
    assert not stopper.is_alive(), "shutdown() did not return"
    assert alive(children_since(before)) == [], "shutdown() stopped half-way"


@pytest.mark.parametrize("pipe", ["fast", "slow"])
def test_shutdown_from_another_thread_during_iteration(pipe):
    make = {
        "fast": lambda: IterableWrapper(range(5000)).sharding_filter(),
        "slow": lambda: IterableWrapper(range(5000)).sharding_filter().map(slow),
    }[pipe]
    for _ in range(10):
        _iterate_while_another_thread_shuts_down(make())


@pytest.mark.stress
def test_shutdown_from_another_thread_during_iteration_200_times():
    for run in range(200):
        pipe = IterableWrapper(range(5000)).sharding_filter()
        _iterate_while_another_thread_shuts_down(pipe.map(slow) if run % 2 else pipe)


def test_an_old_iterator_after_shutdown_raises_service_closed():
    loader = loader_for(pipelines.sharded_pipe(100))
    iterator = iter(loader)
    next(iterator)
    loader.shutdown()
    with pytest.raises(ServiceClosedError, match="shut down"):
        next(iterator)


def test_a_dropped_runtime_stops_its_processes_without_a_garbage_collection():
    """Below DataLoader2 and the reading service (whose ``__del__`` both shut down): no
    reference cycle between the runtime and its parts keeps the processes running until a
    garbage collection."""
    from torchdata.dataloader2.random import SeedGenerator

    from mprs_plus.options import Options
    from mprs_plus.plan import plan
    from mprs_plus.runtime.main.service import ServiceRuntime

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    gc.collect()
    gc.disable()
    try:
        runtime = ServiceRuntime(plan(pipelines.sharded_pipe(1000), 2), Options(num_workers=2))
        main = runtime.start()
        runtime.begin_epoch(SeedGenerator(0))
        iterator = iter(main)
        next(iterator)
        started = children_since(before)
        assert len(started) == 2
        del iterator, main, runtime
        _, still = psutil.wait_procs(started, timeout=STOP_GRACE + 2)
        assert not still, "the processes outlived the last reference to their runtime"
    finally:
        gc.enable()


def _ours_left_to_the_garbage_collector(run) -> list[str]:
    """The objects of this package that ``run()`` left in reference cycles: these, and all
    they hold (a channel's shared memory mapping, 64 MiB per worker), outlive the stop
    until a garbage collection runs, and every later fork copies and every exit unmaps
    them."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        run()
        gc.collect()
        return sorted({type(o).__module__ + "." + type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("mprs_plus")})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_a_stopped_loader_frees_its_shared_memory_without_a_garbage_collection():
    from mprs_plus import DataLoader

    def run():
        loader = DataLoader(list(range(300)), batch_size=8, num_workers=2)
        iterator = iter(loader)
        next(iterator)
        del iterator  # stopped mid-epoch
        assert len([batch for batch in loader]) == 38  # and an epoch run to its end
        persistent = DataLoader(list(range(300)), batch_size=8, num_workers=2, persistent_workers=True)
        for _ in range(2):
            assert len(list(persistent)) == 38
        del persistent
        auto = DataLoader(list(range(300)), batch_size=8, num_workers="auto")
        assert len(list(auto)) == 38
        del auto

    assert _ours_left_to_the_garbage_collector(run) == []


def test_a_shut_down_reading_service_frees_its_shared_memory_without_a_garbage_collection():
    def run():
        loader = loader_for(IterableWrapper(range(200)).sharding_filter())
        assert sorted(loader) == list(range(200))
        loader.shutdown()

    assert _ours_left_to_the_garbage_collector(run) == []


def test_a_control_message_a_stopped_worker_never_reads_fails_in_bounded_time(monkeypatch, short_stop_grace):
    from mprs_plus.runtime.main import supervisor

    monkeypatch.setattr(supervisor, "CONTROL_WAIT", 1.0)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    loader = loader_for(pipelines.sharded_pipe(1000))
    iterator = iter(loader)
    next(iterator)
    workers = children_since(before)
    freeze(workers[0])
    try:
        for _ in range(4):  # fills its control channel
            loader.reading_service._pause()
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"mprs_plus worker \d \(pid {workers[0].pid}\) has not read its control channel"):
            loader.reading_service._pause()
        assert time.monotonic() - started < 1.0 + STOP_GRACE + 1  # the bounded wait, then the stop
        assert alive(workers) == []  # the service was shut down, its processes ended
        with pytest.raises(ServiceClosedError):
            loader.reading_service._resume()
    finally:
        kill_all(workers)
        loader.shutdown()


def test_batches_held_through_a_stop_stay_intact():
    """The stop closes the main process's ends of the channels as soon as the workers closed
    theirs, before they are reaped: batches lent from those channels, still held by the
    loop, keep their memory and their values."""
    import torch

    from mprs_plus import DataLoader

    class Filled(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return torch.full((1 << 16,), float(i))  # 256 KiB: lent, not copied

    iterator = iter(DataLoader(Filled(), batch_size=2, num_workers=2))
    held = [next(iterator) for _ in range(5)]
    del iterator  # stopped mid-epoch, the workers ahead with unread batches
    for number, batch in enumerate(held):
        assert batch.shape == (2, 1 << 16)
        assert bool((batch[0] == 2 * number).all()) and bool((batch[1] == 2 * number + 1).all())


def _filled_dataset(count: int):
    import torch

    class Filled(torch.utils.data.Dataset):
        def __len__(self):
            return count

        def __getitem__(self, i):
            return torch.full((1 << 16,), float(i))  # 256 KiB: lent from the channel, not copied

    return Filled()


@pytest.mark.parametrize("front", ["DataLoader", "DataLoader unordered", "DataLoader2"])
def test_a_batch_the_loop_dropped_is_held_by_nothing_of_ours(front):
    """``del batch`` frees it: no reader keeps the last item it handed out (a batch lent
    from a channel's shared memory, or one on the GPU, would stay alive until the next
    ``next()``, and at a stop would keep its channel mapped here until the iterator goes)."""
    import weakref

    from mprs_plus import DataLoader
    from mprs_plus.transport import lending

    if front == "DataLoader2":
        loader = loader_for(IterableWrapper(range(12)).sharding_filter().map(pipelines.filled_tensor))
    else:
        loader = DataLoader(_filled_dataset(12), batch_size=None, num_workers=2, in_order=front == "DataLoader")
    before = lending()
    iterator = iter(loader)
    seen = []
    for _ in range(6):
        batch = next(iterator)
        seen.append(int(batch[0]))
        dropped = weakref.ref(batch)
        del batch
        assert dropped() is None, "a reader still holds the batch the loop dropped"
    assert lending().held_bytes == before.held_bytes
    rest = [int(batch[0]) for batch in iterator]
    assert sorted(seen + rest) == list(range(12))
    if front != "DataLoader unordered":
        assert seen == list(range(6))
    if front == "DataLoader2":
        loader.shutdown()


def test_a_stop_drops_what_the_main_process_read_and_never_handed_out():
    """A message the main process took out of a channel ahead of its turn (held by the
    reader's mux) goes with the stop, before it lets go of the workers: its lent items
    then no longer map the channel here, and the workers' exits free its pages. The
    iterator, which holds the mux, is still referenced."""
    import weakref

    loader = loader_for(IterableWrapper(range(12)).sharding_filter().map(pipelines.filled_tensor))
    iterator = iter(loader)
    assert float(next(iterator)[0]) == 0
    mux = loader.reading_service._runtime._reader._mux

    class Item:
        pass

    planted = Item()
    freed = weakref.ref(planted)
    mux._held[1] = (0, 1, [planted])  # as a message of worker 1's channel read ahead
    del planted
    loader.shutdown()
    assert freed() is None, "the stop left what the main process read ahead in its mux"
    del iterator
