"""Starting the service: when children start, what a failure to start leaves behind.

Under fork the children start with the first epoch, the dispatch process and the first
worker with their Reset already queued; under spawn and forkserver they start in
``start()``. Whatever fails, and wherever, no process and no channel is left behind.
"""

from __future__ import annotations

import errno
import gc
import multiprocessing.context
import os

import psutil
import pytest
from torchdata.dataloader2 import DataLoader2
from torchdata.dataloader2.random import SeedGenerator
from torchdata.datapipes.iter import IterableWrapper

import pipelines
from mprs_plus import MultiProcessingReadingService
from mprs_plus.options import Options
from mprs_plus.plan import plan
from mprs_plus.runtime.main.service import ServiceRuntime

CHANNEL = "memfd:mprs_plus"


def channel_descriptors() -> int:
    """Descriptors of this process that hold a channel's shared memory (a memfd, on
    either transport)."""
    found = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            found += CHANNEL in os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed since listed
    return found


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def dispatched(n: int) -> object:
    pipe = IterableWrapper(range(n))
    return pipe.sharding_round_robin_dispatch(pipelines.SHARDING_PRIORITIES.MULTIPROCESSING).map(pipelines.identity)


@pytest.fixture
def fork_fails_at(monkeypatch):
    """``fail(k)``: the k-th process start of this test (from 0) fails as fork does when
    the system is out of processes; the others start."""
    original = multiprocessing.context.ForkProcess._Popen
    starts = []

    def fail(k: int) -> list[int]:
        def popen(process_obj):
            starts.append(process_obj.name)
            if len(starts) == k + 1:
                raise OSError(errno.EAGAIN, "Resource temporarily unavailable (test)")
            return original(process_obj)

        monkeypatch.setattr(multiprocessing.context.ForkProcess, "_Popen", staticmethod(popen))
        return starts

    return fail


# The dispatch process and worker 0 start first, with their Reset queued; worker 1 then
# starts and gets its Reset once every child is forked.
@pytest.mark.parametrize("failing", [0, 1, 2], ids=["dispatch", "worker 0", "worker 1"])
def test_a_child_that_fails_to_start_is_a_clear_error_and_leaves_nothing(fork_fails_at, failing):
    gc.collect()
    held, before = channel_descriptors(), children()
    starts = fork_fails_at(failing)
    loader = DataLoader2(dispatched(20), reading_service=MultiProcessingReadingService(2, multiprocessing_context="fork"))
    try:
        with pytest.raises(OSError, match=r"Resource temporarily unavailable \(test\)"):
            next(iter(loader))
    finally:
        loader.shutdown()
    assert starts == ["mprs_plus dispatch process", "mprs_plus worker 0", "mprs_plus worker 1"][: failing + 1]
    _, alive = psutil.wait_procs([psutil.Process(pid) for pid in children() - before if psutil.pid_exists(pid)], 10)
    assert not alive, "a child started before the failure outlived it"
    gc.collect()
    assert channel_descriptors() == held


def test_under_fork_children_start_with_the_first_epoch():
    runtime = ServiceRuntime(plan(pipelines.sharded_pipe(6), 2), Options(num_workers=2, multiprocessing_context="fork"))
    before = children()
    try:
        main = runtime.start()
        assert children() == before  # nothing to do until an epoch begins
        runtime.begin_epoch(SeedGenerator(0))
        assert len(children() - before) == 2
        assert sorted(item[0] for item in main) == list(range(6))
    finally:
        runtime.stop()


def test_a_service_stopped_before_its_first_epoch_started_nothing_and_keeps_no_channel():
    gc.collect()
    held, before = channel_descriptors(), children()
    runtime = ServiceRuntime(plan(dispatched(6), 2), Options(num_workers=2, multiprocessing_context="fork"))
    runtime.start()
    assert channel_descriptors() > held  # the count below checks something
    runtime.stop()
    assert children() == before
    del runtime
    gc.collect()
    assert channel_descriptors() == held


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_first_epoch_too_large_to_queue_still_starts(method):
    """A Reset larger than a control channel holds waits for its reader: such a child is
    started first, and the Reset sent to it as to a running child."""
    runtime = ServiceRuntime(plan(dispatched(8), 2), Options(num_workers=2, multiprocessing_context=method))
    try:
        main = runtime.start()
        runtime.begin_epoch(SeedGenerator(0), iter_reset_fn=pipelines.Ballast(4 << 20))
        assert sorted(main) == list(range(8))
    finally:
        runtime.stop()


@pytest.mark.parametrize("failing", [0, 2, 6], ids=["first", "dispatch to worker 1", "last"])
def test_a_channel_that_fails_to_open_releases_every_channel_opened_before(monkeypatch, failing):
    """Channels: the dispatch control channel, 2 from the dispatch process to the workers,
    then per worker a control channel and a data channel (7 in all)."""
    from mprs_plus.backends import local as service  # where the local backend opens its channels

    gc.collect()
    held = channel_descriptors()
    opened = []

    def open_channel(*args, **kwargs):
        if len(opened) == failing:
            raise OSError(errno.EMFILE, "Too many open files (test)")
        opened.append(service.open_channel.__wrapped__(*args, **kwargs))
        return opened[-1]

    open_channel.__wrapped__ = service.open_channel
    monkeypatch.setattr(service, "open_channel", open_channel)
    runtime = ServiceRuntime(plan(dispatched(6), 2), Options(num_workers=2, multiprocessing_context="fork"))
    with pytest.raises(OSError, match=r"Too many open files \(test\)"):
        runtime.start()
    assert len(opened) == failing
    assert channel_descriptors() == held  # released by the stop itself, not by a garbage collection
    runtime.stop()


def test_a_script_without_a_main_guard_under_spawn_is_told_to_add_one(tmp_path):
    """Under spawn a worker imports the main module: a script that iterates its loader at
    module level starts a loader inside the worker. The worker's error names the guard
    to add, not something that could not be pickled; the script ends, nothing is left."""
    script = tmp_path / "train.py"
    script.write_text(
        "import mprs_plus\n"
        "for batch in mprs_plus.DataLoader(list(range(20)), batch_size=4, num_workers=2, multiprocessing_context='spawn'):\n"
        "    pass\n"
    )
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode != 0
    assert 'under `if __name__ == "__main__":`' in done.stderr
    assert "cannot be pickled" not in done.stderr
