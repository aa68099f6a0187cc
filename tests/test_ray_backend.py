"""The Ray backend on a local Ray cluster of two nodes (one per module: starting one takes
seconds): the same items, order and checkpoints as local workers, and every way an actor
can end (an exception, ray.kill, a lost node, a stopped actor at shutdown, a killed driver)
is a clear error or a clean end, with no actor left behind."""

from __future__ import annotations

import concurrent.futures
import functools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest

ray = pytest.importorskip("ray", reason="the Ray backend's tests need Ray: pip install mprs_plus[ray]")

from ray.cluster_utils import Cluster  # noqa: E402
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES  # noqa: E402
from torchdata.dataloader2 import DataLoader2  # noqa: E402
from torchdata.datapipes.iter import IterableWrapper  # noqa: E402

import mprs_plus  # noqa: E402
import pipelines  # noqa: E402
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
# The bound this backend states for a dead actor to become an error: Ray's node-failure
# detection (above: about 4 s) plus a few seconds.
DEATH_BOUND = 20.0


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


def _alive_actors() -> list[str]:
    """The actors Ray does not report dead, asked in a helper thread: the control store's
    client waits in native code, where pytest-timeout's signal cannot end a wait."""
    from ray._private.state import actors

    answer: list[list[str]] = []
    helper = threading.Thread(
        target=lambda: answer.append([a for a, info in actors().items() if info["State"] != "DEAD"]), daemon=True
    )
    helper.start()
    helper.join(60.0)
    assert answer, "Ray's control store did not list the actors within 60 s"
    return answer[0]


def _wait_until_no_actor() -> None:
    """Until Ray reports every actor dead, or ``DEATH_BOUND`` has passed."""
    deadline = time.monotonic() + DEATH_BOUND
    while _alive_actors() and time.monotonic() < deadline:
        time.sleep(0.2)  # polling Ray's state: nothing to be woken by


@pytest.fixture(autouse=True)
def no_actor_left(request):
    if "cluster" not in request.fixturenames:
        yield
        return
    yield
    # close() waits until Ray reports each killed actor dead: nothing to wait for here.
    assert _alive_actors() == [], "actors left behind"


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
    stages = [stamps for _, stamps in got]
    assert all(s["post"] == os.getpid() for s in stages)
    assert len({s["worker"] for s in stages}) == 2 and os.getpid() not in {s["worker"] for s in stages}
    assert len(nodes) == 2


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


def _blocked_pipe():
    """Items 0 and 1 come at once, then worker 0 blocks on its next item (2)."""
    return IterableWrapper(range(6)).sharding_filter().map(functools.partial(pipelines.block_on, bad=2))


def test_a_killed_actor_is_an_error_naming_the_worker_and_its_node(cluster):
    loader = _loader(_blocked_pipe(), RayBackend(num_cpus_per_worker=0), worker_prefetch_cnt=0, main_prefetch_cnt=0)
    try:
        iterator = iter(loader)
        assert [next(iterator), next(iterator)] == [0, 1]
        worker = _processes(loader)[0]
        ray.kill(worker.actor)
        start = time.monotonic()
        with pytest.raises(ProcessDiedError) as caught:
            next(iterator)
        assert time.monotonic() - start < DEATH_BOUND
    finally:
        loader.shutdown()
    message = str(caught.value)
    assert "mprs_plus worker 0 (Ray actor on " in message and "node id" in message
    assert "create a new DataLoader2" in message and "ray" not in type(caught.value).__module__


def test_a_removed_node_is_an_error_within_the_bound(cluster):
    doomed = cluster.add_node(num_cpus=1, resources={"doomed": 4})
    backend = RayBackend(num_cpus_per_worker=0, resources={"doomed": 1})
    loader = _loader(_blocked_pipe(), backend, worker_prefetch_cnt=0, main_prefetch_cnt=0)
    try:
        iterator = iter(loader)
        assert [next(iterator), next(iterator)] == [0, 1]
        cluster.remove_node(doomed, allow_graceful=False)
        start = time.monotonic()
        with pytest.raises(ProcessDiedError, match=r"mprs_plus worker \d \(Ray actor on .*node id"):
            next(iterator)
        assert time.monotonic() - start < DEATH_BOUND
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
    assert took < 8.0  # the 1 s wait for the kills, the join of the watchers, the local steps


DRIVER = textwrap.dedent(
    """
    import sys, time
    import ray
    from torchdata.dataloader2 import DataLoader2
    from torchdata.datapipes.iter import IterableWrapper
    import mprs_plus, pipelines

    ray.init(address=sys.argv[1], runtime_env={"env_vars": {"PYTHONPATH": sys.argv[2]}}, log_to_driver=False)
    service = mprs_plus.MultiProcessingReadingService(2, backend=mprs_plus.RayBackend(num_cpus_per_worker=0))
    loader = DataLoader2(IterableWrapper(range(100)).sharding_filter(), reading_service=service)
    iterator = iter(loader)
    next(iterator)
    print("running", flush=True)
    time.sleep(120)  # killed by the test long before
    """
)


def test_a_driver_killed_by_sigkill_leaves_no_actor(cluster):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, ROOT]))
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, cluster.address, env["PYTHONPATH"]],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert driver.stdout.readline().strip() == "running"
        assert _alive_actors(), "the driver's actors should be running"
        driver.kill()
        driver.wait(30)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(30)
    _wait_until_no_actor()
    assert _alive_actors() == []


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
    assert not ray.is_initialized()  # disconnected: the service connected
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


def test_ray_started_for_the_service_is_stopped_at_shutdown():
    """address=None starts a Ray of this machine and stops it at shutdown. Runs in a
    subprocess: this module's process is attached to the test cluster."""
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
        assert not ray.is_initialized()
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=DRIVER_TIMEOUT)
    assert result.stdout.strip().endswith("ok"), result.stderr[-3000:]
    assert mprs_plus.RayBackend(address=None).address is None


def test_items_cross_a_ray_channel_writable_and_equal():
    """What a pull carries: the transport's pickling, large buffers out of band; the
    receiver gets writable copies, as from the shared-memory transport."""
    import numpy
    import torch

    from mprs_plus.backends.ray.channel import ChannelSpec, RayReceiver, _pack

    item = {"array": numpy.arange(100_000, dtype=numpy.int64), "tensor": torch.arange(50_000.0), "tiny": [1, "a"]}
    receiver = RayReceiver(ChannelSpec("test", 4, False))
    receiver._buffer.append(_pack(None, item))
    receiver._ended = True  # no sender actor here: nothing more to pull
    got = receiver._take()
    assert numpy.array_equal(got["array"], item["array"]) and torch.equal(got["tensor"], item["tensor"])
    assert got["tiny"] == [1, "a"] and got["array"].flags.writeable
    got["tensor"] += 1  # writable: no warning, no error


def test_ray_endpoints_implement_the_declared_channel_protocols():
    """The runtime calls nothing but ``transport.Sender``/``Receiver`` on the Ray channel's
    ends; one receiver waits its own way, several by ``transport.wait_together``."""
    from mprs_plus.backends.ray.channel import open_ray_channel
    from mprs_plus.transport import Receiver, Sender, wait_readable

    sender, receiver = open_ray_channel(capacity_items=4, capacity_bytes=1 << 20)
    other = open_ray_channel(capacity_items=4, capacity_bytes=1 << 20)[1]
    try:
        assert isinstance(sender, Sender) and isinstance(receiver, Receiver)
        for r in (receiver, other):
            r._ended = True  # no sender actor here: the end of the stream is all there is
        assert wait_readable([receiver, other], timeout=1.0) == [receiver, other]
        assert receiver.wait(timeout=1.0) == [receiver]
    finally:
        receiver.close()
        other.close()


def test_an_answered_pull_wakes_an_armed_waiter_and_only_an_armed_one():
    """A pull's answer completes its future in Ray's thread; the callback must make the
    armed wake-up pipe readable (else a waiter sleeps its whole recheck interval), must not
    write while nobody is armed, and must not touch the pipe once the receiver is closed
    (its descriptor numbers may belong to another file by then)."""
    from mprs_plus.backends.ray.channel import open_ray_channel
    from mprs_plus.transport.channel import poll_waitables

    before = len(os.listdir("/proc/self/fd"))
    receiver = open_ray_channel(capacity_items=4, capacity_bytes=1 << 20)[1]
    fd = receiver.arm()
    assert isinstance(fd, int)
    assert poll_waitables([fd], 0) == []
    receiver._answered(None)  # what Ray's thread runs when a pull's answer arrives
    assert poll_waitables([fd], 0) == [fd]
    receiver.disarm(True)  # the waiter woke: the wake-up is consumed
    assert poll_waitables([fd], 0) == []
    receiver._answered(None)  # nobody armed: nothing to wake
    assert poll_waitables([fd], 0) == []
    receiver.close()
    receiver._answered(None)  # a late answer after close: no write, no error
    assert receiver.arm() is None
    assert len(os.listdir("/proc/self/fd")) == before


class _Clock:
    """The channel's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class _PullsByHand:
    """A sender's actor as a receiver sees it (``host.pull.remote(...).future()``): each
    pull's answer is a future that the test completes, or never does."""

    def __init__(self) -> None:
        self.answers: list[concurrent.futures.Future] = []
        self.pull = self

    def remote(self, cid: str, asked: int, seq: int):
        future = concurrent.futures.Future()
        self.answers.append(future)
        return types.SimpleNamespace(future=lambda: future)


def _receiver_of(host):
    from mprs_plus.backends.ray.channel import open_ray_channel

    receiver = open_ray_channel(capacity_items=4, capacity_bytes=1 << 20)[1]
    receiver._spec.host = host
    return receiver


def test_a_pull_counts_as_lost_only_past_the_bound_that_applies_to_it(monkeypatch):
    """Until the sender's actor first answers, it may still be starting (on a loaded
    machine that took more than a minute): its pulls wait ``FIRST_ANSWER``. Once it has
    answered, a pull unanswered for ``LOST_PULL`` since it was asked and since that answer
    breaks the channel, and the receiver says why."""
    from mprs_plus.backends.ray import channel
    from mprs_plus.transport import ChannelBroken

    clock = _Clock()
    monkeypatch.setattr(channel, "time", clock)
    never_starts, starts = _PullsByHand(), _PullsByHand()
    first, second = _receiver_of(never_starts), _receiver_of(starts)
    try:
        assert not first.has_input() and len(never_starts.answers) == 2  # two pulls asked
        assert not second.has_input()
        clock.now += channel.LOST_PULL + 1  # no answer yet: the actors may still be starting
        assert not first.has_input() and not second.has_input()
        starts.answers[0].set_result(([], False))  # the second actor runs: its first answer
        assert not second.has_input()
        clock.now += channel.LOST_PULL - 1  # its other pull is older, but the answer is recent
        assert not second.has_input()
        clock.now += 2
        assert second.has_input()
        with pytest.raises(ChannelBroken, match="has not answered a pull for 60 s"):
            second.recv(timeout=0)
        clock.now += channel.FIRST_ANSWER - channel.LOST_PULL  # the first actor: past its bound
        assert first.has_input()
        with pytest.raises(ChannelBroken, match="has not answered its first pull within 180 s"):
            first.recv(timeout=0)
    finally:
        first.close()
        second.close()


def _actor_side_sender(capacity: int = 8):
    """A data sender as it lives in its actor (its box in this process), for the pull's
    own tests: ``serve_pull`` is what the actor runs for a receiver's pull."""
    from mprs_plus.backends.ray.channel import _box, open_ray_channel

    sender = open_ray_channel(capacity_items=capacity, capacity_bytes=1 << 20)[0]
    state = sender.__getstate__()
    sender.__setstate__(state)
    return sender, _box(state["cid"]), state["cid"]


def _until_a_pull_waits(box) -> None:
    """Until the pull's thread waits in the box (it notifies no one when it begins: looked
    at every 10 ms, for at most 10 s)."""
    deadline = time.monotonic() + 10
    with box.cv:
        while box.pullers != 1:
            assert time.monotonic() < deadline, "the pull never began to wait"
            box.cv.wait(0.01)


def _lingering_pull(limit: int, then):
    """A pull served in a thread with one message in the box; once it waits, ``then(sender)``
    runs; returns the answer's messages, unpickled, and whether the stream ended."""
    from mprs_plus.backends.ray import channel

    sender, box, cid = _actor_side_sender()
    sender.send("first")
    answer = []
    pull = threading.Thread(target=lambda: answer.append(channel.serve_pull(cid, limit, 0)))
    pull.start()
    _until_a_pull_waits(box)
    then(sender)
    pull.join(10)
    assert not pull.is_alive(), "the pull did not answer"
    (taken, ended), = answer
    return [channel.pickle.loads(stream) for stream, _, _ in taken], ended


def test_a_pull_lingers_for_more_messages_and_answers_when_its_share_is_there(monkeypatch):
    """A pull that found one message waits for more (the linger); a message sent while it
    lingers leaves in the same answer, which comes as soon as the pull's share is there.
    The linger is made long so that only the second message can end it."""
    from mprs_plus.backends.ray import channel

    monkeypatch.setattr(channel, "HAND_ON", 60.0)

    def send_another(sender):
        assert sender.peer_waiting(), "a lingering pull is a waiting reader: the batching should send at once"
        sender.send("second")

    assert _lingering_pull(2, send_another) == (["first", "second"], False)


def test_a_lingering_pull_answers_once_its_oldest_message_has_waited_the_hand_on_time(monkeypatch):
    """Without its share, the pull answers with what it has when its oldest message has
    waited HAND_ON: never sooner (that is the batching it buys), and with that message."""
    from mprs_plus.backends.ray import channel

    monkeypatch.setattr(channel, "HAND_ON", 0.05)
    sender, box, cid = _actor_side_sender()
    sender.send("only")
    stamp = box.stamps[0]
    taken, ended = channel.serve_pull(cid, 8, 0)
    assert time.monotonic() >= stamp + 0.05
    assert [channel.pickle.loads(stream) for stream, _, _ in taken] == ["only"] and not ended
    assert not box.stamps and not box.queue


def test_a_close_ends_a_lingering_pull_with_the_end_of_the_stream(monkeypatch):
    from mprs_plus.backends.ray import channel

    monkeypatch.setattr(channel, "HAND_ON", 60.0)
    assert _lingering_pull(8, lambda sender: sender.close()) == (["first"], True)


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
