"""One lifecycle state, a stop whose every step runs, a wiring frozen once written, and
one count of the items handed out.

The state (``runtime/main/state.py``) only moves forward: NEW, PREPARED once every
channel is wired, RUNNING once every child is started, STOPPING as a stop begins, STOPPED
once it is done. Whatever else asks "is the service stopped?" (the read gate, sends,
launches, the statistics) reads it.
"""

from __future__ import annotations

import inspect

import pytest
from torchdata.dataloader2 import DataLoader2
from torchdata.dataloader2.random import SeedGenerator
from torchdata.datapipes.iter import IterableWrapper

import mprs_plus
from mprs_plus.errors import ServiceClosedError
from mprs_plus.options import Options
from mprs_plus.plan import plan
from mprs_plus.runtime.main import supervisor as supervisor_module
from mprs_plus.runtime.main.inprocess import InProcessRuntime
from mprs_plus.runtime.main.service import ServiceRuntime
from mprs_plus.runtime.main.state import State
from mprs_plus.runtime.main.topology import plan_topology


def _runtime(method: str = "fork", n: int = 12) -> ServiceRuntime:
    return ServiceRuntime(
        plan(IterableWrapper(range(n)).sharding_filter(), 2), Options(num_workers=2, multiprocessing_context=method)
    )


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_the_state_moves_forward_from_new_to_stopped(method):
    runtime = _runtime(method)
    try:
        assert runtime.lifecycle.state is State.NEW
        main = runtime.start()
        # Under fork the children start with the first epoch; under spawn in start().
        assert runtime.lifecycle.state is (State.PREPARED if method == "fork" else State.RUNNING)
        runtime.begin_epoch(SeedGenerator(0))
        assert runtime.lifecycle.state is State.RUNNING
        assert sorted(main) == list(range(12))
    finally:
        runtime.stop()
    assert runtime.lifecycle.state is State.STOPPED
    with pytest.raises(ServiceClosedError, match="shut down"):
        runtime.begin_epoch(SeedGenerator(0))


def test_a_service_stopped_before_it_started_is_stopped():
    runtime = _runtime()
    runtime.stop()
    assert runtime.lifecycle.state is State.STOPPED
    runtime.stop()  # idempotent
    assert runtime.lifecycle.state is State.STOPPED


def test_every_stop_step_runs_whatever_the_first_one_raised():
    """The first step (a last look at the service) fails: the children are still ended,
    the channels released and the state reaches STOPPED; the caller gets the error."""
    runtime = _runtime()
    main = runtime.start()
    runtime.begin_epoch(SeedGenerator(0))
    assert sorted(main) == list(range(12))
    pids = [link.process.pid for link in runtime._topology.started()]
    assert len(pids) == 2

    def fails() -> None:
        raise OSError("a last look that fails (test)")

    runtime._supervisor.at_stop(fails)
    with pytest.raises(OSError, match=r"a last look that fails \(test\)"):
        runtime.stop()
    # Reaped: each link keeps the exit record in place of the closed process handle.
    assert [link.process.pid for link in runtime._topology.started()] == pids
    assert all(link.process.exitcode is not None for link in runtime._topology.started())
    assert runtime.lifecycle.state is State.STOPPED
    runtime.stop()  # stopped once is stopped: nothing raises again


def test_the_steps_after_ending_the_children_run_when_ending_them_raises(monkeypatch):
    real = supervisor_module.stop_processes

    def ends_then_fails(*args, **kwargs):
        real(*args, **kwargs)
        raise RuntimeError("ending the children failed (test)")

    monkeypatch.setattr(supervisor_module, "stop_processes", ends_then_fails)
    runtime = _runtime()
    main = runtime.start()
    runtime.begin_epoch(SeedGenerator(0))
    assert sorted(main) == list(range(12))
    with pytest.raises(RuntimeError, match=r"ending the children failed \(test\)"):
        runtime.stop()
    assert runtime.lifecycle.state is State.STOPPED
    # The main process's ends of the data channels were let go of by the later step.
    for _, receiver in runtime._topology.data_receivers():
        with pytest.raises(Exception):
            receiver.recv()


def test_the_wiring_is_written_once_and_then_frozen():
    topology = plan_topology(plan(IterableWrapper(range(4)).sharding_filter(), 2), 2)
    worker = topology.workers[0]
    worker.control = "control end"
    worker.data += ("data end",)
    topology.freeze()
    with pytest.raises(RuntimeError, match="internal error"):
        worker.control = "another control end"
    with pytest.raises(RuntimeError, match="internal error"):
        worker.data += ("another data end",)
    assert (worker.control, worker.data) == ("control end", ("data end",))
    worker.attach("process")
    with pytest.raises(RuntimeError, match="internal error"):
        worker.attach("another process")
    with pytest.raises(RuntimeError, match="internal error"):
        worker.process = "another process"
    assert worker.process == "process"


def test_a_started_service_has_a_frozen_topology():
    runtime = _runtime()
    try:
        runtime.start()
        with pytest.raises(RuntimeError, match="internal error"):
            runtime._topology.workers[0].data = ()
    finally:
        runtime.stop()


def test_the_in_process_runtime_has_the_surface_of_the_service_runtime():
    def surface(runtime: object) -> set[str]:
        return {name for name in dir(runtime) if not name.startswith("_")}

    options = Options(num_workers=0)
    in_process = InProcessRuntime(IterableWrapper(range(3)), options)
    runtime = _runtime()
    try:
        assert surface(runtime) - {"plan"} == surface(in_process)
        for name in ("start", "begin_epoch", "pause", "resume", "limit", "stats", "stop", "read_cursor"):
            ours, theirs = getattr(runtime, name), getattr(in_process, name)
            assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters), name
    finally:
        runtime.stop()
        in_process.stop()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_shutdown_leaves_the_state_stopped(num_workers):
    service = mprs_plus.MultiProcessingReadingService(num_workers, multiprocessing_context="fork")
    loader = DataLoader2(IterableWrapper(range(10)).sharding_filter(), reading_service=service)
    try:
        assert sorted(loader) == list(range(10))
        runtime = loader.reading_service._runtime
        assert runtime.lifecycle.state is State.RUNNING
    finally:
        loader.shutdown()
    assert runtime.lifecycle.state is State.STOPPED


def test_statistics_count_only_the_items_handed_out_in_this_process():
    """A restored epoch starts its count where the checkpoint was: the statistics of the
    restored service show the items it handed out itself, as the cursor that checkpoints
    read counts them."""
    pipe = IterableWrapper(range(40)).sharding_filter()

    def service() -> mprs_plus.MultiProcessingReadingService:
        return mprs_plus.MultiProcessingReadingService(2, multiprocessing_context="fork")

    loader = DataLoader2(pipe, reading_service=service())
    try:
        iterator = iter(loader)
        first = [next(iterator) for _ in range(10)]
        assert loader.reading_service.stats().segment("main").items_in == 10
        state = loader.state_dict()
    finally:
        loader.shutdown()
    restored = DataLoader2.from_state(state, service())
    try:
        rest = list(restored)
        assert sorted(first + rest) == list(range(40))
        assert restored.reading_service.stats().segment("main").items_in == 30
    finally:
        restored.shutdown()
