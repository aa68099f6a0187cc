"""The Ray backend on a local Ray cluster of two nodes (one per module: starting one takes
seconds): the same items, order and checkpoints as local workers, and every way an actor
can end (an exception, ray.kill, a lost node, a stopped actor at shutdown, a killed driver)
is a clear error or a clean end, with no actor left behind. With worker_restarts a dead
actor is replaced and the loop gets the batches of the run nobody killed (the same set
with in_order=False), whether it died in worker_init_fn or deep into an epoch of a
dataset with state; a poison sample is its batch's error, and the epoch goes on."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest

ray = pytest.importorskip("ray", reason="the Ray backend's tests need Ray: pip install -e '.[ray]' in the checkout")

from ray.cluster_utils import Cluster  # noqa: E402
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES  # noqa: E402
from torchdata.dataloader2 import DataLoader2  # noqa: E402
from torchdata.datapipes.iter import IterableWrapper  # noqa: E402

import mprs_plus  # noqa: E402
import pipelines  # noqa: E402
from ray_actors import alive_actors, end_warm_actors_and_check_none_left  # noqa: E402
from conftest import unstopped_services  # noqa: E402
from mprs_plus import MultiProcessingReadingService, ProcessDiedError, RayBackend  # noqa: E402

# Each Ray loader starts an actor process per child, and each imports torch: seconds apiece
# on an idle machine, and with this suite on two workers beside a second suite on two cores,
# up to 100 s for a test of three loaders. The bounds stay hang detectors, with room.
pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
# A driver script of its own (its start, Ray's and its loader's), inside a test's bound.
DRIVER_TIMEOUT = 240

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
# How the pipelines of this directory reach the actors: Ray's runtime_env (a real job
# would ship its code with working_dir or py_modules; see RayBackend).
RUNTIME_ENV = {"env_vars": {"PYTHONPATH": os.pathsep.join([TESTS, ROOT])}}
# A lost node is reported dead by the control store after these health checks fail: a
# check a second, 4 failures in a row (a node whose processes died: about 4 s). Each check
# may take 5 s: a raylet starved of CPU by the tests' own workers on two cores must never
# be taken for lost (Ray would end it, and every call of this driver into it would hang).
FAST_NODE_FAILURE = {"health_check_period_ms": 1000, "health_check_failure_threshold": 4, "health_check_timeout_ms": 5000}
# Actors on the second node: their data channels to this process are streams.
SECOND = {"second": 1}
# The bound this backend states for a dead actor to become an error: Ray's node-failure
# detection (above: about 4 s) plus a few seconds.
DEATH_BOUND = 20.0
# Where the call also starts the actors: each imports torch, 12 to 33 s apiece here when
# the suite's other worker is busy; a failure that hung would still exceed it.
STARTING_BOUND = DEATH_BOUND + 60.0


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False, "_system_config": FAST_NODE_FAILURE},
    )
    cluster.add_node(num_cpus=2, resources={"second": 4})
    try:
        ray.init(address=cluster.address, runtime_env=RUNTIME_ENV, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _wait_until_no_actor() -> None:
    """Until Ray reports every actor dead, or ``DEATH_BOUND`` has passed."""
    deadline = time.monotonic() + DEATH_BOUND
    while alive_actors() and time.monotonic() < deadline:
        time.sleep(0.2)  # polling Ray's state: nothing to be woken by


@pytest.fixture(autouse=True)
def no_actor_left(request):
    if "cluster" not in request.fixturenames:
        yield
        return
    yield
    end_warm_actors_and_check_none_left(unstopped_services)


# Local workers of a process connected to Ray start from a forkserver: Ray does not
# support forking its driver (docs/ray.md, "When things fail").
LOCAL = "forkserver"


def _loader(pipe, backend=None, num_workers=2, **kwargs):
    if backend is None:
        kwargs.setdefault("multiprocessing_context", LOCAL)
    service = MultiProcessingReadingService(num_workers, backend=backend, **kwargs)
    return DataLoader2(pipe, reading_service=service)


def _run(pipe, backend=None, seed=3, **kwargs):
    loader = _loader(pipe, backend, **kwargs)
    loader.seed(seed)
    try:
        return list(loader)
    finally:
        loader.shutdown()


def _processes(loader):
    return [link.process for link in loader.reading_service._runtime._supervisor.topology.children()]


def test_the_seed_pipeline_runs_its_workers_on_both_nodes(cluster):
    """The seed's wrapper (its extra reference in NoGraph): dispatch and workers in actors,
    spread over the two nodes, the post stage in this process; the items as locally."""
    loader = _loader(pipelines.NoGraphWrapper(8), RayBackend(scheduling_strategy="SPREAD", num_cpus_per_worker=0.5))
    try:
        got = list(loader)
        nodes = {process.where(timeout=60.0)["node_id"] for process in _processes(loader)}
        stats = loader.reading_service.stats()
    finally:
        loader.shutdown()
    assert [item for item, _ in got] == list(range(8))
    # stats() counts what the actors did (their rows live on their nodes) and names the nodes.
    workers = [p for p in stats.processes if p.role == "worker"]
    assert sum(p.items_out for p in workers) == 8 and stats.segment("dispatch").items_out == 8
    assert all("node id" in p.node for p in workers) and "on nodes: dispatch 0: " in stats.summary()
    # What each actor sent over the network, message by message, a line each.
    assert all(p.messages_out > 0 for p in workers) and stats.segment("dispatch").messages_out > 0, str(stats)
    assert "  worker 1 sent " in str(stats) and " messages" in str(stats)
    stages = [stamps for _, stamps in got]
    assert all(s["post"] == os.getpid() for s in stages)
    assert len({s["worker"] for s in stages}) == 2 and os.getpid() not in {s["worker"] for s in stages}
    assert len(nodes) == 2


def test_actors_of_this_machine_map_a_shared_list_on_either_node(cluster):
    """Two nodes of one machine: the pickle carries the bytes too (it may cross machines),
    but each actor maps the block its holder, this process, shares."""
    from mprs_plus import SharedList

    records = SharedList({"label": i} for i in range(40))
    pipe = pipelines.SharedListReader(records).sharding_filter()
    got = _run(pipe, RayBackend(scheduling_strategy="SPREAD", num_cpus_per_worker=0.5))
    assert sorted(item["label"] for item, _, _ in got) == list(range(40))
    assert all(mapped for _, mapped, _ in got)
    assert len({pid for _, _, pid in got}) == 2 and os.getpid() not in {pid for _, _, pid in got}


@pytest.mark.parametrize("dispatch", [True, False], ids=["dispatch", "no dispatch"])
def test_same_items_in_the_same_order_as_local_workers(cluster, dispatch):
    if dispatch:
        make = functools.partial(pipelines.shuffled_pipe, 40)
    else:
        make = lambda: IterableWrapper(range(40)).shuffle().sharding_filter().map(pipelines.double)  # noqa: E731
    local = _run(make())
    assert _run(make(), RayBackend(num_cpus_per_worker=0)) == local
    if dispatch:  # the same set as they come (one run is enough: the reads are the same code)
        assert sorted(_run(make(), RayBackend(num_cpus_per_worker=0), in_order=False)) == sorted(local)


def test_a_checkpoint_goes_from_local_workers_to_ray_and_back(cluster):
    make = functools.partial(pipelines.shuffled_pipe, 30)
    expected = _run(make())
    local = _loader(make())
    local.seed(3)
    try:
        iterator = iter(local)
        got = [next(iterator) for _ in range(7)]
        state = local.state_dict()
    finally:
        local.shutdown()
    on_ray = DataLoader2.from_state(
        state, MultiProcessingReadingService(2, backend=RayBackend(num_cpus_per_worker=0))
    )
    try:
        iterator = iter(on_ray)
        got += [next(iterator) for _ in range(9)]
        state = on_ray.state_dict()
    finally:
        on_ray.shutdown()
    back = DataLoader2.from_state(state, MultiProcessingReadingService(2, multiprocessing_context=LOCAL))
    try:
        got += list(back)
    finally:
        back.shutdown()
    assert got == expected


def test_an_exception_in_a_worker_reads_as_locally_and_names_the_node(cluster):
    pipe = IterableWrapper(range(10)).sharding_filter().map(pipelines.fail_on)
    loader = _loader(pipe, RayBackend(num_cpus_per_worker=0))
    try:
        with pytest.raises(ValueError) as caught:
            list(loader)
    finally:
        loader.shutdown()
    text = "\n".join([str(caught.value), *getattr(caught.value, "__notes__", [])])
    assert "Caught ValueError in worker process 1 (pid " in text
    assert ", node " in text and "bad sample 5" in text


def _raises_within_the_bound(call, match: str | None, bound: float = DEATH_BOUND) -> ProcessDiedError:
    """``call()`` raises a ``ProcessDiedError`` matching ``match`` within ``bound``."""
    start = time.monotonic()
    with pytest.raises(ProcessDiedError, match=match) as caught:
        call()
    assert time.monotonic() - start < bound
    return caught.value


def _blocked_pipe():
    """Items 0 and 1 come at once, then worker 0 blocks on its next item (2)."""
    return IterableWrapper(range(6)).sharding_filter().map(functools.partial(pipelines.block_on, bad=2))


def test_a_killed_actor_is_an_error_naming_the_worker_and_its_node(cluster):
    # On the other node: its stream lands here through a landing process, which sees the
    # break first; the error still names the actor, once its watcher has seen why.
    backend = RayBackend(num_cpus_per_worker=0, resources=SECOND)
    loader = _loader(_blocked_pipe(), backend, worker_prefetch_cnt=0, main_prefetch_cnt=0)
    try:
        iterator = iter(loader)
        assert [next(iterator), next(iterator)] == [0, 1]
        worker = _processes(loader)[0]
        ray.kill(worker.actor)
        error = _raises_within_the_bound(lambda: next(iterator), None)
    finally:
        loader.shutdown()
    message = str(error)
    assert "mprs_plus worker 0 (Ray actor on " in message and "node id" in message
    assert "create a new DataLoader2" in message and "ray" not in type(error).__module__


def test_a_removed_node_is_an_error_within_the_bound(cluster):
    doomed = cluster.add_node(num_cpus=1, resources={"doomed": 4})
    backend = RayBackend(num_cpus_per_worker=0, resources={"doomed": 1})
    loader = _loader(_blocked_pipe(), backend, worker_prefetch_cnt=0, main_prefetch_cnt=0)
    try:
        iterator = iter(loader)
        assert [next(iterator), next(iterator)] == [0, 1]
        cluster.remove_node(doomed, allow_graceful=False)
        _raises_within_the_bound(lambda: next(iterator), r"mprs_plus worker \d \(Ray actor on .*node id")
    finally:
        loader.shutdown()
        # The next test's actors must not be placed on the node before Ray declares it dead.
        _wait_until_declared_dead(doomed.node_id)


def _wait_until_declared_dead(node_id: str) -> None:
    deadline = time.monotonic() + 60.0
    while any(node["NodeID"] == node_id and node["Alive"] for node in ray.nodes()):
        assert time.monotonic() < deadline, "Ray never declared the removed node dead"
        time.sleep(0.2)  # polling Ray's control store for a state change, not synchronising threads


def test_shutdown_with_a_stopped_actor_is_bounded(cluster, short_stop_grace):
    loader = _loader(_blocked_pipe(), RayBackend(num_cpus_per_worker=0), worker_prefetch_cnt=0, main_prefetch_cnt=0)
    try:
        iterator = iter(loader)
        assert next(iterator) == 0
        # The other worker's actor may still be starting: its place is known once it runs.
        where = _processes(loader)[1].where(timeout=60.0)
        assert where is not None, "the second worker's actor never started"
        os.kill(where["pid"], signal.SIGSTOP)  # the nodes of this cluster are this machine
        start = time.monotonic()
    finally:
        loader.shutdown()
    assert time.monotonic() - start < 20.0  # the stop grace (1 s here), escalation, and Ray reporting the kill


def test_shutdown_is_bounded_when_ray_does_not_answer_a_kill(cluster, monkeypatch):
    """A kill waits on Ray's control store in native code; one that never answers must not
    hold the stop: close() gives up after its wait and the actors are Ray's to end."""
    from mprs_plus.backends.ray import placement

    answering = threading.Event()
    real_kill = ray.kill

    def unanswered_kill(actor, **kwargs):
        answering.wait(60.0)  # as a control store that stopped answering
        real_kill(actor, **kwargs)

    monkeypatch.setattr(placement, "_CLOSE_WAIT", 1.0)
    monkeypatch.setattr(placement.ray, "kill", unanswered_kill)
    loader = _loader(IterableWrapper(range(8)).sharding_filter(), RayBackend(num_cpus_per_worker=0))
    try:
        assert next(iter(loader)) == 0
    finally:
        start = time.monotonic()
        loader.shutdown()
        took = time.monotonic() - start
        answering.set()  # Ray answers again: the helpers' kills go through
        for helper in [t for t in threading.enumerate() if t.name == placement.RAY_CALL_THREAD]:
            helper.join(30.0)
        _wait_until_no_actor()
    # Not waiting on the kills that never answer (60 s): their 1 s wait, the watchers, the
    # local steps, with room for a loaded machine.
    assert took < 30.0


DRIVER = textwrap.dedent(
    """
    import sys, time
    import ray
    from torchdata.dataloader2 import DataLoader2
    from torchdata.datapipes.iter import IterableWrapper
    import mprs_plus, pipelines

    ray.init(address=sys.argv[1], runtime_env={"env_vars": {"PYTHONPATH": sys.argv[2]}}, log_to_driver=False)
    # On the other node: each worker's stream lands in a landing process of this machine.
    backend = mprs_plus.RayBackend(num_cpus_per_worker=0, resources={"second": 1})
    service = mprs_plus.MultiProcessingReadingService(2, backend=backend)
    loader = DataLoader2(IterableWrapper(range(100)).sharding_filter(), reading_service=service)
    iterator = iter(loader)
    next(iterator), next(iterator)  # an item of each worker: both streams have landed
    receivers = [r for _, r in loader.reading_service._runtime._supervisor.topology.data_receivers()]
    print("running", *[r._landing.process.pid for r in receivers], flush=True)
    time.sleep(120)  # killed by the test long before
    """
)


def test_a_driver_killed_by_sigkill_leaves_no_actor_and_no_landing_process(cluster):
    import psutil

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, ROOT]))
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, cluster.address, env["PYTHONPATH"]],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        said, *pids = driver.stdout.readline().split()
        assert said == "running" and len(pids) == 2
        landings = [psutil.Process(int(pid)) for pid in pids]
        assert alive_actors(), "the driver's actors should be running"
        driver.kill()
        driver.wait(30)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(30)
    # Their stop pipe's last writer is gone: each landing process ends by itself.
    _, alive = psutil.wait_procs(landings, timeout=30)
    for process in alive:
        process.kill()
    assert alive == [], "landing processes outlived their training process"
    _wait_until_no_actor()
    assert alive_actors() == []


@pytest.fixture
def own_module(tmp_path, monkeypatch):
    """A module of the pipeline's own that this process imports and the nodes do not have."""
    package = tmp_path / "shipped_code"
    package.mkdir()
    (package / "__init__.py").write_text("def triple(x):\n    return 3 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import shipped_code

    yield package, shipped_code
    sys.modules.pop("shipped_code", None)


def test_a_node_without_the_pipelines_code_says_how_to_ship_it(cluster, own_module):
    _, shipped_code = own_module
    pipe = IterableWrapper(range(6)).sharding_filter().map(shipped_code.triple)
    loader = _loader(pipe, RayBackend(num_cpus_per_worker=0))
    try:
        with pytest.raises(ProcessDiedError, match=r"could not load the pipeline's code.*working_dir.*py_modules"):
            list(loader)
    finally:
        loader.shutdown()


def test_a_death_error_waits_for_the_watcher_to_say_why_the_stream_broke(monkeypatch):
    """The window: an actor whose code fails to load closes its stream at once, and the
    main process may read the break before the actor's watcher has seen why. Forced here:
    the reason appears only once the death error has begun waiting for it."""
    from mprs_plus.backends.ray import placement

    waiting = threading.Event()

    class Clock:  # the module's clock; its first sleep says the death error is waiting
        monotonic = staticmethod(time.monotonic)

        @staticmethod
        def sleep(seconds):
            waiting.set()
            time.sleep(seconds)

    monkeypatch.setattr(placement, "time", Clock)
    actor = types.SimpleNamespace(name="worker 0", node="node-a", pid=7, exitcode=None, reason=None, cannot_load=False)

    def watcher():
        if waiting.wait(30):
            actor.reason = "could not load the pipeline's code on its node (No module named 'x')"
            actor.exitcode = 1

    thread = threading.Thread(target=watcher)
    thread.start()
    idle = placement.RayPlacement.__new__(placement.RayPlacement)
    idle._streams = {}  # no data channel: no landing process to ask
    error = idle.death_error([actor])
    thread.join(30)
    assert isinstance(error, ProcessDiedError)
    assert "worker 0 (Ray actor on node-a, pid 7) could not load the pipeline's code" in str(error)


def test_a_channel_that_failed_here_is_the_reason_even_when_its_actor_ended_first():
    """The window: a killed landing process closes its worker's stream, the worker's
    actor ends because of it, and its watcher may report that end before this process
    reads the broken ring. Forced: the actor has ended when the death error is made."""
    from mprs_plus.backends.ray import placement

    class Killed:  # the training process's end of a channel whose landing process was killed
        def failed_here(self):
            return True

        def problem_here(self):
            return "the landing process of this stream (pid 4711) ended with exit status -9"

    service = placement.RayPlacement.__new__(placement.RayPlacement)
    service._streams = {"key": (None, Killed())}
    actor = types.SimpleNamespace(name="worker 1", node="node-a", pid=7, exitcode=1, reason=None)
    error = service.death_error([actor])
    assert isinstance(error, ProcessDiedError)
    assert "pid 4711) ended with exit status -9" in str(error) and "worker 1" not in str(error)


SHIPPING_DRIVER = textwrap.dedent(
    """
    import sys
    import ray, mprs_plus
    from torchdata.dataloader2 import DataLoader2
    from torchdata.datapipes.iter import IterableWrapper
    import shipped_code

    address, package = sys.argv[1], sys.argv[2]
    backend = mprs_plus.RayBackend(address=address, num_cpus_per_worker=0, runtime_env={"py_modules": [package]})
    service = mprs_plus.MultiProcessingReadingService(2, backend=backend)
    loader = DataLoader2(IterableWrapper(range(6)).sharding_filter().map(shipped_code.triple), reading_service=service)
    assert list(loader) == [3 * i for i in range(6)]
    loader.shutdown()
    assert ray.is_initialized()  # the service connected: its warm actors keep the connection
    backend.close()
    assert not ray.is_initialized()  # disconnected with the last of them
    print("ok")
    """
)


def test_attached_by_address_the_code_ships_with_runtime_env_and_the_cluster_stays(cluster, own_module):
    package, _ = own_module
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(package.parent), ROOT]))
    result = subprocess.run(
        [sys.executable, "-c", SHIPPING_DRIVER, cluster.address, str(package)],
        capture_output=True,
        text=True,
        timeout=DRIVER_TIMEOUT,
        env=env,
    )
    assert result.stdout.strip().endswith("ok"), result.stderr[-3000:]
    assert ray.cluster_resources().get("CPU", 0) >= 4  # the cluster we attached to still runs


def test_ray_started_for_the_service_is_stopped_once_its_warm_actors_are_done():
    """address=None starts a Ray of this machine; it stays while the loader's warm actor
    waits for a next loader, and stops when RayBackend.close() ends that actor (with
    warm_for=0: at shutdown). Runs in a subprocess: this module's process is attached to
    the test cluster."""
    code = textwrap.dedent(
        """
        import ray, mprs_plus
        from torchdata.dataloader2 import DataLoader2
        from torchdata.datapipes.iter import IterableWrapper
        backend = mprs_plus.RayBackend(address=None, num_cpus=1, num_cpus_per_worker=0, log_to_driver=False)
        service = mprs_plus.MultiProcessingReadingService(1, backend=backend)
        loader = DataLoader2(IterableWrapper(range(5)).sharding_filter(), reading_service=service)
        assert list(loader) == list(range(5))
        assert ray.is_initialized()
        loader.shutdown()
        assert ray.is_initialized()  # a warm actor waits
        backend.close()
        assert not ray.is_initialized()
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=DRIVER_TIMEOUT)
    assert result.stdout.strip().endswith("ok"), result.stderr[-3000:]
    assert mprs_plus.RayBackend(address=None).address is None


CHATTY_MODULE = textwrap.dedent(
    """
    import warnings

    def speak(x):
        if x < 2:  # the first item of each of the two workers
            print(f"worker says {x}", flush=True)
            warnings.warn(f"worker warns {x}")
        return x
    """
)

QUIET_DRIVER = textwrap.dedent(
    """
    import sys, warnings
    # This process's own banner is not the actors': hide it, so that any banner seen is theirs.
    warnings.filterwarnings("ignore", message=r"\\s*#+\\s*WARNING!", category=UserWarning)
    import mprs_plus
    from torchdata.dataloader2 import DataLoader2
    from torchdata.datapipes.iter import IterableWrapper
    import chatty

    address, path = sys.argv[1], sys.argv[2]
    runtime_env = {"env_vars": {"PYTHONPATH": path}}
    backend = mprs_plus.RayBackend(address=address, num_cpus_per_worker=0, runtime_env=runtime_env)
    service = mprs_plus.MultiProcessingReadingService(2, backend=backend)
    loader = DataLoader2(IterableWrapper(range(6)).sharding_filter().map(chatty.speak), reading_service=service)
    assert list(loader) == list(range(6))
    print("epoch done", flush=True)
    sys.stdin.readline()  # the actors' output reaches this process through Ray: until the test has read it
    loader.shutdown()
    print("ok", flush=True)
    """
)


def test_actors_print_only_what_the_pipeline_prints(cluster, tmp_path):
    """torchdata's deprecation banner, which a local worker does not repeat, stays out of the
    actors' output that Ray forwards; the worker's own prints and warnings reach the driver."""
    (tmp_path / "chatty.py").write_text(CHATTY_MODULE)
    path = os.pathsep.join([str(tmp_path), ROOT])
    env = dict(os.environ, PYTHONPATH=path, RAY_DEDUP_LOGS="0")  # every actor's lines, none folded
    driver = subprocess.Popen(
        [sys.executable, "-c", QUIET_DRIVER, cluster.address, path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    expected = {"worker says 0", "worker says 1", "worker warns 0", "worker warns 1"}
    seen: list[str] = []
    try:
        # An actor writes the banner when it imports torchdata, before it runs any item; Ray
        # forwards each actor's stderr in order: once its warning is here, its banner would be.
        for line in driver.stdout:
            seen.append(line)
            if all(any(marker in text for text in seen) for marker in expected):
                break
        with contextlib.suppress(BrokenPipeError):  # the driver ended early: its output says why
            driver.stdin.write("\n")
        rest, _ = driver.communicate(timeout=DRIVER_TIMEOUT)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(30)
    output = "".join(seen) + rest
    assert "ok" in output.splitlines(), output[-3000:]
    assert all(marker in output for marker in expected), output[-3000:]
    assert "deprecated" not in output, output[-3000:]


def _array_and_tensor(item):
    import numpy
    import torch

    return numpy.full(100_000, item, dtype=numpy.int64), torch.full((50_000,), float(item))


def test_items_cross_the_data_streams_writable_and_equal(cluster):
    """Large buffers out of band, received into memory of the training process: writable
    arrays and tensors, as from the shared-memory transport."""
    pipe = IterableWrapper(range(6)).sharding_filter().map(_array_and_tensor)
    got = _run(pipe, RayBackend(num_cpus_per_worker=0))
    for i, (array, tensor) in enumerate(got):
        assert array.shape == (100_000,) and (array == i).all() and array.flags.writeable
        assert tensor.shape == (50_000,) and bool((tensor == i).all())
        tensor += 1  # writable: no warning, no error


def test_ray_endpoints_implement_the_declared_channel_protocols():
    """The runtime calls nothing but ``transport.Sender``/``Receiver`` on the Ray backend's
    ends: control over Ray calls, data over streams."""
    from mprs_plus.backends.ray.channel import open_ray_channel, open_stream_channel
    from mprs_plus.transport import Receiver, Sender
    from mprs_plus.transport.stream import new_secret

    for sender, receiver in (
        open_ray_channel(capacity_items=4, capacity_bytes=1 << 20),
        open_stream_channel(new_secret(), capacity_items=4, capacity_bytes=1 << 20),
    ):
        assert isinstance(sender, Sender) and isinstance(receiver, Receiver)
        receiver.close()
        sender.close()


def _data_receivers(loader):
    return [receiver for _, receiver in loader.reading_service._runtime._supervisor.topology.data_receivers()]


def _tcp_of_this_process():
    import psutil

    return psutil.Process().net_connections(kind="tcp")


def test_shutdown_leaves_no_connection_or_listening_port_in_the_training_process(cluster):
    import psutil

    listening = {tuple(c.laddr) for c in _tcp_of_this_process() if c.status == psutil.CONN_LISTEN}
    # On the other node, read here (no landing): the workers' items come over TCP into
    # this process (on this node, shared memory).
    backend = RayBackend(num_cpus_per_worker=0, resources=SECOND, landing=False)
    loader = _loader(IterableWrapper(range(20)).sharding_filter(), backend)
    try:
        assert list(loader) == list(range(20))
        ours = {r._sock.getsockname() for r in _data_receivers(loader) if r.connected()}
        assert len(ours) == 2  # one connection per worker, made by this process
    finally:
        loader.shutdown()
    left = [c for c in _tcp_of_this_process() if tuple(c.laddr) in ours]
    assert left == [], f"connections left after shutdown: {left}"
    assert {tuple(c.laddr) for c in _tcp_of_this_process() if c.status == psutil.CONN_LISTEN} <= listening


def test_streams_from_another_node_land_in_shared_memory_and_their_processes_end_at_shutdown(cluster):
    """By default a worker on another node streams to a landing process of this node,
    which writes into a shared-memory ring: this process holds no connection to the
    workers, reads their arrays from a lend area, and the landing processes end with
    the loader."""
    import psutil

    from mprs_plus.transport.landing import BROKEN

    pipe = IterableWrapper(range(16)).sharding_filter().map(_megabyte)
    loader = _loader(pipe, RayBackend(num_cpus_per_worker=0, resources=SECOND))
    try:
        got = [int(array[0]) for array in loader]
        stats = loader.reading_service.stats()
        receivers = _data_receivers(loader)
        assert all(r._near is not None and r._sock is None for r in receivers)
        landings = [r._landing.process for r in receivers]
        # Each landing process holds the one connection to its worker; this process none.
        workers = {tuple(c.raddr) for p in landings for c in psutil.Process(p.pid).net_connections(kind="tcp")}
        assert len(workers) == 2
        assert not [c for c in _tcp_of_this_process() if c.raddr and tuple(c.raddr) in workers]
    finally:
        loader.shutdown()
    assert got == list(range(16))
    assert stats.large_buffers.lent > 0 and stats.segment("worker").items_out == 16, str(stats)
    # Ended by the shutdown: at the end of its stream (its worker stopped), or with it
    # broken (a worker killed after the stop's grace), never left running or crashed.
    assert all(p.poll() in (0, BROKEN) for p in landings), [p.poll() for p in landings]


def test_a_killed_landing_process_is_an_error_that_says_so(cluster):
    backend = RayBackend(num_cpus_per_worker=0, resources=SECOND)
    loader = _loader(_blocked_pipe(), backend, worker_prefetch_cnt=0, main_prefetch_cnt=0)
    try:
        iterator = iter(loader)
        assert [next(iterator), next(iterator)] == [0, 1]
        landings = [r._landing.process for r in _data_receivers(loader)]
        for process in landings:
            process.kill()
        _raises_within_the_bound(lambda: next(iterator), r"landing process of this stream \(pid \d+\) ended with exit status -9")
    finally:
        loader.shutdown()


def test_a_landing_process_that_cannot_start_is_an_error_that_says_why(cluster, monkeypatch):
    from mprs_plus.transport import landing

    def cannot(*args, **kwargs):
        raise OSError("no interpreter to run it")

    monkeypatch.setattr(landing.Landing, "start", cannot)
    backend = RayBackend(num_cpus_per_worker=0, resources=SECOND)
    loader = _loader(IterableWrapper(range(4)).sharding_filter(), backend)
    try:
        _raises_within_the_bound(
            lambda: list(loader), r"could not start the landing process.*no interpreter.*landing=False", STARTING_BOUND
        )
    finally:
        loader.shutdown()


def test_listen_interface_names_where_the_workers_listen(cluster):
    """Both nodes of this cluster are this host: "lo" exists on each, so the workers
    listen on 127.0.0.1 and the landing processes connect there."""
    import psutil

    backend = RayBackend(num_cpus_per_worker=0, resources=SECOND, listen_interface="lo")
    loader = _loader(IterableWrapper(range(8)).sharding_filter(), backend)
    try:
        assert list(loader) == list(range(8))  # every worker's channel is settled after its items
        landings = [r._landing.process for r in _data_receivers(loader)]
        peers = {c.raddr.ip for p in landings for c in psutil.Process(p.pid).net_connections(kind="tcp") if c.raddr}
    finally:
        loader.shutdown()
    assert len(landings) == 2 and peers == {"127.0.0.1"}


def test_a_listen_interface_that_a_node_lacks_is_an_error_that_names_it(cluster):
    backend = RayBackend(num_cpus_per_worker=0, resources=SECOND, listen_interface="nope0")
    loader = _loader(IterableWrapper(range(4)).sharding_filter(), backend)
    try:
        _raises_within_the_bound(
            lambda: list(loader), r"no network interface 'nope0' .*its interfaces: .*lo", STARTING_BOUND
        )
    finally:
        loader.shutdown()


class _WritesAFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _until_closed(conn):
    conn.settimeout(30)
    with contextlib.suppress(ConnectionResetError):
        while conn.recv(4096):
            pass


def test_strangers_at_a_workers_door_are_refused_unread_and_the_loader_goes_on(cluster, tmp_path):
    """Before this process connects, a worker's channel listens: a wrong secret and a
    pickle sent at once are both closed unread (the file is never written), the items
    come as ever, and stats() counts both at each worker's port."""
    import pickle
    import socket
    import struct

    path = str(tmp_path / "written")
    evil = pickle.dumps(_WritesAFile(path), protocol=5)
    evil = struct.pack("<QQ", 8 + len(evil), 0) + evil
    loader = _loader(IterableWrapper(range(8)).sharding_filter(), RayBackend(num_cpus_per_worker=0))
    try:
        iterator = iter(loader)
        receivers = _data_receivers(loader)
        assert not any(r.connected() for r in receivers)  # nothing read yet: the workers listen
        for receiver in receivers:
            address = receiver._address(60.0)
            with socket.create_connection(address, timeout=30) as wrong:
                wrong.recv(40)
                wrong.sendall(os.urandom(64))  # a proof made without the secret
                _until_closed(wrong)
            with socket.create_connection(address, timeout=30) as pickler:
                pickler.sendall(evil)
                _until_closed(pickler)
        assert list(iterator) == list(range(8))
        # Counted in the actor before it closed them; stats() fetches the count with the
        # actor's figures, each fetch bounded (an actor slow to answer keeps its last ones).
        deadline = time.monotonic() + 60
        stats = loader.reading_service.stats()
        while stats.refused_connections < 4 and time.monotonic() < deadline:
            stats = loader.reading_service.stats()
    finally:
        loader.shutdown()
    assert not os.path.exists(path)
    workers = [p for p in stats.processes if p.role == "worker"]
    assert [p.refused_connections for p in workers] == [2, 2], repr(stats)
    assert stats.refused_connections == 4
    assert "  4 connections refused at the workers' ports (they did not prove the service's secret)" in str(stats)


def _exit_mid_message(item):
    """Large items, each sent alone as soon as it is made: item 1 is 64 MiB, and a thread
    ends the process once its sending has begun and not finished (the reader reads nothing
    meanwhile: the kernel's buffers fill, the send waits half done)."""
    import numpy

    if item == 1:
        threading.Thread(target=_exit_once_a_message_is_half_sent, daemon=True).start()
        return numpy.zeros(64 << 20, dtype=numpy.uint8)
    return numpy.full(1 << 18, item, dtype=numpy.uint8)


def _exit_once_a_message_is_half_sent():
    from mprs_plus.transport.stream import StreamSender

    code = StreamSender._write.__code__
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for frame in list(sys._current_frames().values()):
            while frame is not None:
                if frame.f_code is code and frame.f_locals.get("started") and frame.f_locals.get("views"):
                    os._exit(1)
                frame = frame.f_back
        time.sleep(0.001)  # looking for a state of another thread: nothing to be woken by


@pytest.mark.parametrize("landing", [True, False], ids=["landed", "read here"])
def test_a_stream_cut_in_the_middle_of_an_item_is_a_process_died_error(cluster, landing):
    pipe = IterableWrapper(range(4)).sharding_filter().map(_exit_mid_message)
    backend = RayBackend(num_cpus_per_worker=0, resources=SECOND, landing=landing)  # a stream: the other node
    loader = _loader(pipe, backend, num_workers=1, worker_prefetch_cnt=0, main_prefetch_cnt=0)
    try:
        iterator = iter(loader)
        assert (next(iterator) == 0).all()
        worker = _processes(loader)[0]
        worker.join(60.0)  # ended half way through item 1, while this process read nothing
        assert not worker.is_alive()
        # The bytes of item 1 that were sent, then the end of the stream.
        _raises_within_the_bound(lambda: next(iterator), "mprs_plus worker 0")
    finally:
        loader.shutdown()


def test_pause_resume_limit_and_hooks_run_in_the_actors(cluster):
    """The same control messages as local children: the pause, resume and limit functions
    run in the dispatch actor and the worker actors, the items go on in order."""
    from torchdata.dataloader2 import SequentialReadingService

    from test_pause import HooksFromAnotherService, read_in_chunks

    pipelines.COUNTS.clear()
    ours = MultiProcessingReadingService(2, backend=RayBackend(num_cpus_per_worker=0))
    service = SequentialReadingService(HooksFromAnotherService(), ours)
    loader = DataLoader2(pipelines.pause_aware_pipe(10, True), reading_service=service)
    try:
        first, pauses = read_in_chunks(loader, 5)
        second = list(loader)
    finally:
        loader.shutdown()
    assert pauses == 2 and [v for v, _ in first] == [v for v, _ in second] == list(range(10))
    assert pipelines.COUNTS["limit_fn(5)"] == 1
    for _, counts in second:
        assert counts["worker"]["pause_fn"] == counts["worker"]["resume_fn"] == 2
        assert counts["dispatch"]["pause_fn"] == 2 and counts["dispatch"]["limit_fn(5)"] == 1


# -- on the training process's node: shared memory -------------------------------------------


def _on_this_node():
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)


def _megabyte(item):
    import numpy

    return numpy.full(1 << 18, item, dtype=numpy.float32)


def _unix_names():
    with open("/proc/net/unix") as table:
        return table.read()


def test_workers_on_the_trainers_node_hand_over_shared_memory_and_lend_their_arrays(cluster):
    """Placed on this process's node (the nodes of this cluster share one address: the
    node id decides), a worker's channel here is a shared-memory ring handed over a
    Unix-domain socket: no TCP connection, arrays as views of its lend area."""
    pipe = IterableWrapper(range(16)).sharding_filter().map(_megabyte)
    loader = _loader(pipe, RayBackend(num_cpus_per_worker=0, scheduling_strategy=_on_this_node()))
    try:
        got = [int(array[0]) for array in loader]
        stats = loader.reading_service.stats()
        receivers = _data_receivers(loader)
        assert all(r._near is not None and r._sock is None for r in receivers)
        names = _unix_names()
        assert not any(r.key in names for r in receivers)  # the sockets went with the hand-over
    finally:
        loader.shutdown()
    assert got == list(range(16))
    assert stats.large_buffers.lent > 0 and stats.segment("worker").items_out == 16, str(stats)


def test_a_killed_actor_on_the_trainers_node_is_an_error_naming_the_worker(cluster):
    backend = RayBackend(num_cpus_per_worker=0, scheduling_strategy=_on_this_node())
    loader = _loader(_blocked_pipe(), backend, worker_prefetch_cnt=0, main_prefetch_cnt=0)
    try:
        iterator = iter(loader)
        assert [next(iterator), next(iterator)] == [0, 1]
        assert all(r._near is not None for r in _data_receivers(loader))
        worker = _processes(loader)[0]
        ray.kill(worker.actor)
        _raises_within_the_bound(lambda: next(iterator), r"mprs_plus worker 0 \(Ray actor on .*node id")
    finally:
        loader.shutdown()


def test_a_receiver_whose_senders_answer_comes_while_it_polls_still_settles_its_end(monkeypatch):
    """The window: the answer of the sender's actor (where it listens) arrives between the
    receiver's look at it (none yet) and the stream's own look. The stream then connected
    straight over TCP, skipping the hand-over or landing the receiver would have chosen.
    Forced: the first look at the answer says "not yet", every later look has it."""
    from mprs_plus.backends.ray import channel
    from mprs_plus.transport import stream as st

    spec = st.StreamSpec(st.new_secret(), 4, 1 << 20)
    address = st.listen(spec)  # a listening sender in this process stands for the actor's
    sender = st.StreamSender(spec)

    class LateAnswer(channel.ActorAddress):
        def __init__(self):
            self.looks = 0

        def answer(self, timeout):
            self.looks += 1
            return None if self.looks == 1 else (address[0], address[1], "another node", None)

        def __call__(self, timeout):
            return address  # what the stream's own look would find

    monkeypatch.setattr(channel, "_node", "this node")
    receiver = channel.NearReceiver(spec)
    receiver.connect_to(LateAnswer())
    try:
        assert receiver.poll() is False  # not decided yet: nothing connected behind its back
        assert receiver._sock is None
        # Decided at the next look: another node, no landing here, so the stream it is.
        thread = threading.Thread(target=lambda: sender.send("hello"), daemon=True)
        thread.start()
        assert receiver.recv(30) == "hello"
        thread.join(30)
        assert receiver._address == address and receiver._near is None
    finally:
        receiver.release()
        sender.release()
        st.close_listeners()


@pytest.mark.parametrize("bad", [3, "", b"eth0"])
def test_a_listen_interface_that_is_not_a_name_is_refused_when_the_backend_is_made(bad):
    with pytest.raises(TypeError, match="listen_interface must be an interface's name"):
        RayBackend(listen_interface=bad)


def test_mprs_plus_dataloader_gives_the_same_batches_on_ray_as_with_local_workers(cluster):
    """torch's loader API on the Ray backend: the same batches and worker randomness."""
    import torch
    from loader_datasets import Randomized, plain

    def batches(**kwargs):
        torch.manual_seed(11)
        loader = mprs_plus.DataLoader(Randomized(9), batch_size=2, shuffle=True, num_workers=2, **kwargs)
        return [plain(batch) for batch in loader]

    local = batches(multiprocessing_context=LOCAL)
    assert batches(backend=RayBackend(num_cpus_per_worker=0.5)) == local


SCRIPT_DRIVER = textwrap.dedent(
    """
    import sys

    import ray
    import torch
    from torch.utils.data import Dataset
    from torchdata.dataloader2 import DataLoader2
    from torchdata.datapipes.iter import IterableWrapper

    import mprs_plus


    class Aug(Dataset):
        # The training script's own class, as users write them: Ray ships it by value.
        def __len__(self):
            return 9

        def __getitem__(self, i):
            return {"index": i, "draw": torch.rand(2)}


    def double(x):
        return 2 * x


    def batches(**kwargs):
        torch.manual_seed(11)
        loader = mprs_plus.DataLoader(Aug(), batch_size=2, shuffle=True, num_workers=2, **kwargs)
        return [(b["index"].tolist(), b["draw"].tolist()) for b in loader]


    if __name__ == "__main__":
        local = batches(multiprocessing_context="fork")
        ray.init(address=sys.argv[1], log_to_driver=False)
        assert batches(backend=mprs_plus.RayBackend(num_cpus_per_worker=0)) == local
        service = mprs_plus.MultiProcessingReadingService(2, backend=mprs_plus.RayBackend(num_cpus_per_worker=0))
        loader = DataLoader2(IterableWrapper(range(6)).sharding_filter().map(double), reading_service=service)
        assert sorted(loader) == [0, 2, 4, 6, 8, 10]
        loader.shutdown()
        print("by value")

        import unshipped_data  # a module of this machine only: the nodes cannot load it

        loader = mprs_plus.DataLoader(
            unshipped_data.Numbers(), batch_size=2, num_workers=2, backend=mprs_plus.RayBackend(num_cpus_per_worker=0)
        )
        try:
            list(loader)
        except RuntimeError as exc:
            print("error:", exc)
    """
)


def test_a_dataset_defined_in_the_training_script_runs_on_the_actors(cluster, tmp_path):
    """The script's own definitions (``__main__``) reach the actors by value, as with Ray's
    tasks; code of a module the nodes lack is an error saying so, not a crash."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT_DRIVER)
    elsewhere = tmp_path / "elsewhere"  # not the script's folder, which Ray puts on the actors' path
    elsewhere.mkdir()
    (elsewhere / "unshipped_data.py").write_text(
        "from torch.utils.data import Dataset\n\n\nclass Numbers(Dataset):\n"
        "    def __len__(self):\n        return 4\n\n    def __getitem__(self, i):\n        return i\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(elsewhere), ROOT]))
    result = subprocess.run(
        [sys.executable, str(script), cluster.address], capture_output=True, text=True, timeout=DRIVER_TIMEOUT, env=env
    )
    lines = result.stdout.strip().splitlines()
    assert "by value" in lines, result.stderr[-3000:]
    error = lines[-1]
    assert error.startswith("error: DataLoader worker process"), result.stdout[-3000:] + result.stderr[-3000:]
    assert "could not load" in error and "unshipped_data" in error and "working_dir" in error, error
    assert "out-of-memory" not in error and "exited unexpectedly" not in error, error


# -- worker_restarts: a dead actor replaced (docs/worker-restarts.md) ------------------------


def _restart_batches(loader_class, dataset, epochs=1, **kwargs):
    """Each epoch's batches as lists, the global seed set as a training script sets it."""
    import torch

    torch.manual_seed(0)
    loader = loader_class(dataset, batch_size=4, num_workers=2, **kwargs)
    return [[_plain_batch(batch) for batch in loader] for _ in range(epochs)], loader


def _plain_batch(batch):
    if isinstance(batch, (list, tuple)):
        return [_plain_batch(part) for part in batch]
    return batch.tolist()


def _replacement_warnings(caught):
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return [text for text in said if "A new worker replaces" in text]


def test_a_dead_actors_error_keeps_none_of_the_callers_frames_alive(cluster):
    """The error ``ray.get`` raises for a dead actor sits in a reference cycle with Ray's
    frames, and through them with its caller's: what the caller held (a loader, its
    runtime) would live until Python's collector runs, and a dropped loader's actors with
    it. Through ``get_without_cycle`` it goes as the caller returns, the collector off."""
    import gc
    import weakref

    from restart_datasets import Dies

    from mprs_plus.backends.ray.calls import get_without_cycle

    actor = ray.remote(num_cpus=0)(Dies).remote()
    assert ray.get(actor.pid.remote(), timeout=STARTING_BOUND) > 0
    died = actor.die.remote()
    ready, _ = ray.wait([died], timeout=DEATH_BOUND)
    assert ready

    class Held:
        pass

    def look(held):
        try:
            get_without_cycle(died, timeout=0)
        except ray.exceptions.RayActorError:
            return True
        return False

    held = Held()
    gone = weakref.ref(held)
    gc.collect()
    gc.disable()
    try:
        assert look(held)
        del held
        assert gone() is None
    finally:
        gc.enable()


def test_the_training_process_calls_ray_get_only_through_the_helper_that_clears_its_errors():
    """A direct ``ray.get`` in the training process's code brings the cycle back."""
    backend = os.path.join(ROOT, "mprs_plus", "backends", "ray")
    direct = [
        name
        for name in sorted(os.listdir(backend))
        if name.endswith(".py") and name not in ("calls.py", "actor.py")
        and "ray.get(" in open(os.path.join(backend, name)).read()
    ]
    assert direct == []


def test_a_killed_actor_is_replaced_from_its_latest_record_and_the_batches_are_torchs(cluster, tmp_path):
    """Worker 1's actor (on the other node: its records and items reach this process
    through a landing process) kills itself at sample 301, deep into the epoch (2 ms
    samples: its records, every 0.1 s, are sent on its data channel). A new actor replaces
    it, loads the latest record the loop had passed and reads only the samples after it:
    worker 1's first batch is read once. The loop gets torch's batches, as with no kill."""
    import warnings

    import torch
    from restart_datasets import Draws, LogsReads

    work = dict(n=400, seconds=0.002)
    expected, _ = _restart_batches(torch.utils.data.DataLoader, Draws(**work), multiprocessing_context=LOCAL)
    backend = RayBackend(num_cpus_per_worker=0, scheduling_strategy="SPREAD")
    uninterrupted, _ = _restart_batches(mprs_plus.DataLoader, Draws(**work), backend=backend, worker_restarts=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dataset = LogsReads(str(tmp_path), kill_at=301, marker=str(tmp_path / "killed"), **work)
        got, loader = _restart_batches(mprs_plus.DataLoader, dataset, backend=backend, worker_restarts=1)
        stats = loader.stats()
        del loader
    assert (tmp_path / "killed").exists()  # the death happened
    assert got == expected and uninterrupted == expected
    said = _replacement_warnings(caught)
    assert len(said) == 1 and "replacement 1 of worker_restarts=1" in said[0], said
    assert re.search(r"worker 1 \(pid \d+\) was killed by SIGKILL", said[0]), said[0]
    assert [(made.worker, made.epoch) for made in stats.replacements] == [(1, 1)]
    reads = [int(line) for log in tmp_path.glob("reads-*") for line in log.read_text().split()]
    assert reads.count(4) == 1  # not replayed from the epoch's start
    assert reads.count(301) == 2  # the sample that killed the actor is read again, by its replacement


def test_a_persistent_actor_killed_in_epoch_two_is_replaced_with_that_epochs_generators(cluster, tmp_path):
    """Persistent actors carry their generators from epoch 1 into epoch 2: the states the
    dead one had as epoch 2 began exist only in it, and reach this process as its record.
    Python's collector stays off while the loader lives: dropping the loader stops its
    actors at once, though one of them died (no Ray error keeps the loader alive)."""
    import gc
    import warnings

    import torch
    from restart_datasets import Draws, killed_in_epoch_two

    marker, armed = str(tmp_path / "killed"), tmp_path / "armed"
    expected, _ = _restart_batches(
        torch.utils.data.DataLoader, Draws(), epochs=3, persistent_workers=True, multiprocessing_context=LOCAL
    )
    gc.collect()
    gc.disable()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # warm_for=0: a stopped actor is killed, and Ray's list shows whether it stopped.
            backend = RayBackend(num_cpus_per_worker=0, warm_for=0)
            got, loader = killed_in_epoch_two(marker, armed, _plain_batch, backend=backend)
            stats = loader.stats()
            del loader
        assert alive_actors() == [], f"actors left behind{unstopped_services()}"
    finally:
        gc.enable()
    assert os.path.exists(marker)
    assert got == expected
    assert len(_replacement_warnings(caught)) == 1
    assert [made.epoch for made in stats.replacements] == [2]


def test_a_spent_budget_on_ray_is_the_error_saying_how_many_were_replaced(cluster, tmp_path):
    import warnings

    from restart_datasets import ChainedKills

    dataset = ChainedKills([(9, str(tmp_path / "first")), (30, str(tmp_path / "second"))])
    loader = mprs_plus.DataLoader(
        dataset, batch_size=4, num_workers=2, worker_restarts=1, backend=RayBackend(num_cpus_per_worker=0)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        spent = r"1 dead worker\(s\) were replaced before, all that worker_restarts=1"
        with pytest.raises(RuntimeError, match=spent) as caught:
            list(loader)
    del loader
    assert (tmp_path / "second").exists()
    assert "ray" not in type(caught.value).__module__


def test_worker_restarts_with_a_dispatch_actor_is_refused_at_start_saying_what_to_do(cluster):
    """A running dispatch actor cannot be handed a replacement's channels: refused with the
    ValueError that says so, before any item, and no actor is left."""
    pipe = IterableWrapper(range(8)).sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING).map(abs)
    service = MultiProcessingReadingService(
        num_workers=2, worker_restarts=1, backend=RayBackend(num_cpus_per_worker=0)
    )
    loader = DataLoader2(pipe, reading_service=service)
    try:
        with pytest.raises(ValueError, match="worker_restarts=0 with this backend"):
            list(loader)
    finally:
        loader.shutdown()


def test_a_replacement_is_killed_at_shutdown_while_the_dead_actors_kill_waits_on_ray(cluster, tmp_path, monkeypatch):
    """The kill of an actor Ray already knows dead may wait on its control store; close()
    kills every actor on its own, so the replacement still ends, and the stop stays bounded."""
    import warnings

    from mprs_plus.backends.ray import placement as ray_placement
    from restart_datasets import Draws

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        loader = mprs_plus.DataLoader(
            Draws(kill_at=5, marker=str(tmp_path / "killed")),
            batch_size=4,
            num_workers=2,
            persistent_workers=True,
            worker_restarts=1,
            backend=RayBackend(num_cpus_per_worker=0, warm_for=0),  # the live actors are killed too
        )
        assert len(list(loader)) == 12
    runtime = loader._run.runtime
    processes = list(runtime._supervisor.placement.processes)
    dead = {process.actor._actor_id.hex() for process in processes if process.exitcode is not None}
    live = {process.actor._actor_id.hex() for process in processes} - dead
    assert len(dead) == 1 and len(live) == 2  # worker 1's first actor, and the two running now

    answering = threading.Event()
    real_kill = ray.kill

    def kill(actor, **kwargs):
        if actor._actor_id.hex() in dead:
            answering.wait(60.0)  # as a control store slow to answer about an actor it has dead
        real_kill(actor, **kwargs)

    monkeypatch.setattr(ray_placement, "_CLOSE_WAIT", 2.0)
    monkeypatch.setattr(ray_placement.ray, "kill", kill)
    try:
        start = time.monotonic()
        runtime.stop()
        took = time.monotonic() - start
        deadline = time.monotonic() + DEATH_BOUND
        while live & set(alive_actors()) and time.monotonic() < deadline:
            time.sleep(0.2)  # polling Ray's state: nothing to be woken by
        assert not live & set(alive_actors()), "an actor outlived the stop"
    finally:
        answering.set()
        for helper in [t for t in threading.enumerate() if t.name == ray_placement.RAY_CALL_THREAD]:
            helper.join(30.0)
        del loader, runtime
    assert took < 30.0  # not the 60 s kill: its 2 s wait, the watchers, the local steps, with room for load


def test_the_reading_service_replaces_a_dead_actor(cluster, tmp_path):
    """DataLoader2 over Ray actors: a DataPipe stream cannot start at a position, so the
    replacement replays its epoch, seeded as the dead one was; the items are the run's."""
    import warnings

    from restart_datasets import KillAt

    def pipeline(marker):
        return IterableWrapper(range(40)).shuffle().sharding_filter().map(KillAt(23, marker))

    expected = _run(pipeline(None), seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = _run(pipeline(str(tmp_path / "killed")), RayBackend(num_cpus_per_worker=0), seed=7, worker_restarts=1)
    assert (tmp_path / "killed").exists()
    assert got == expected


@functools.lru_cache(maxsize=None)
def _torch_draws() -> list:
    """torch's batches of ``restart_datasets.Draws()`` (48 samples, batches of 4, 2 workers)."""
    import torch
    from restart_datasets import Draws

    return _restart_batches(torch.utils.data.DataLoader, Draws(), multiprocessing_context=LOCAL)[0][0]


@pytest.mark.parametrize("first_death", ["with every batch before sent", "holding batches it never sent"])
def test_a_poison_sample_on_ray_is_that_batchs_error_and_the_epoch_goes_on(cluster, tmp_path, first_death):
    """Index 29 (batch 7, worker 1's fourth) kills every actor that reads it. An actor keeps
    no slot this process can read saying which batch it makes: its death is placed at the
    batches received from it. When it had sent every batch before the poison one (here the
    poison sample waits for the loop to have batch 5), its careful replacement dies at the
    same batch: two deaths. When it held batches it never sent (here its batching clock is
    stopped), the first replacement hands them on one by one and dies at batch 7, and the
    second dies there too: three. Either way the loop gets, in batch 7's place, torch's
    words naming its indices; the next next() goes on, and later batches have the run's indices."""
    import warnings

    import torch
    from restart_datasets import Draws, InWorkers, PoisonOnceReached, read_through

    reached = tmp_path / "reached"
    if first_death == "holding batches it never sent":
        dataset, init, deaths = Draws(kill_at=29, poison=True), InWorkers(record_seconds=1e9, stopped_clock=True), 3
    else:
        dataset, init, deaths = PoisonOnceReached(str(reached), kill_at=29), None, 2
    torch.manual_seed(0)
    loader = mprs_plus.DataLoader(
        dataset,
        batch_size=4,
        num_workers=2,
        worker_restarts=3,
        worker_init_fn=init,
        backend=RayBackend(num_cpus_per_worker=0),
    )

    def after(got):
        if len(got) == 6:
            reached.touch()  # the loop has batch 5, worker 1's last before the poison one

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, errors = read_through(loader, _plain_batch, after)
        made = loader.stats().replacements
        del loader
    expected = _torch_draws()
    assert len(errors) == 1, errors
    assert "ray" not in type(errors[0]).__module__
    assert re.search(r"DataLoader worker \(pid \d+\) is killed by signal: Killed", str(errors[0])), errors[0]
    assert "indices [28, 29, 30, 31]" in str(errors[0])
    assert got.index(None) == 7 and len(got) == len(expected)
    assert got[:7] == expected[:7]
    # The draws the poison batch made are lost with it: later batches have the run's indices.
    assert [[row[0] for row in b] for b in got[8:]] == [[row[0] for row in b] for b in expected[8:]]
    assert [m.poison for m in made] == [False] * (deaths - 1) + [True]
    assert [m.worker for m in made] == [1] * deaths
    if deaths == 3:
        assert made[0].items < 3  # the first actor died with batches it had made and not sent
    assert len(_replacement_warnings(caught)) == deaths


def test_in_order_false_on_ray_gives_torchs_batches_as_a_set(cluster, tmp_path):
    import warnings

    from restart_datasets import Draws

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got, loader = _restart_batches(
            mprs_plus.DataLoader,
            Draws(kill_at=21, marker=str(tmp_path / "killed")),
            in_order=False,
            worker_restarts=1,
            backend=RayBackend(num_cpus_per_worker=0),
        )
        made = loader.stats().replacements
        del loader
    assert (tmp_path / "killed").exists()
    assert len(made) == 1
    assert sorted(map(str, got[0])) == sorted(map(str, _torch_draws()))


def test_actors_dead_in_worker_init_fn_at_their_first_element_and_deep_in_an_iterable_with_state(cluster, tmp_path):
    """Worker 1's first actor dies in worker_init_fn, before its stream began: that names no
    element, so its replacement, which dies at its first element (element 1), is replaced
    too (an iterable dataset cannot leave an element out: taking the two deaths for one
    element's would end the run). The next one dies deep into the epoch, at element 301 of
    this iterable dataset with state_dict() (records taken after every batch here); the
    last loads the latest record the loop had passed, the dataset's state with it, and
    makes only the elements after it. The loop gets torch's batches, in order."""
    import warnings
    from collections import Counter

    import torch
    from restart_datasets import CountsWithState, InWorkers

    n, kill_at = 400, 301  # worker 1's element 150 of 200
    expected, _ = _restart_batches(
        torch.utils.data.DataLoader, CountsWithState(n), worker_init_fn=InWorkers(), multiprocessing_context=LOCAL
    )
    markers = [str(tmp_path / name) for name in ("in init", "first", "deep")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, loader = _restart_batches(
            mprs_plus.DataLoader,
            CountsWithState(n, str(tmp_path), kill_at, markers[2], kills=[(1, markers[1])]),
            worker_init_fn=InWorkers(record_seconds=0.0, dies=1, marker=markers[0]),
            worker_restarts=3,
            backend=RayBackend(num_cpus_per_worker=0),
        )
        made_by = loader.stats().replacements
        del loader
    assert all(os.path.exists(marker) for marker in markers)
    assert got == expected
    assert [(m.worker, m.poison) for m in made_by] == [(1, False)] * 3
    assert len(_replacement_warnings(caught)) == 3
    made = Counter(int(line) for log in tmp_path.glob("made-*") for line in log.read_text().split())
    assert sorted(made) == list(range(n))
    assert made[1] == 2  # by the actor that died making it, and by the next one
    assert made[3] == 1  # not made again from the epoch's start after the deep death
    assert made[kill_at] == 2  # the element that killed the actor, made again by its replacement
    assert 0 < sum(count - 1 for count in made.values()) < 150
