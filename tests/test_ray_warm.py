"""Warm Ray actors (``RayBackend(warm_for=...)``) on a local Ray cluster of two nodes, one
for the module: an epoch of ``persistent_workers=False`` and a next loader take the actors
of the one before and give the same batches and hook calls as new actors; an idle actor
that died is not handed out; ``prestart`` starts actors that a loader then takes; nothing
stays after ``close()`` or a SIGKILL of the training process; a warm actor that dies is
replaced under ``worker_restarts``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest

ray = pytest.importorskip("ray", reason="the Ray backend's tests need Ray: pip install -e '.[ray]' in the checkout")

from ray.cluster_utils import Cluster  # noqa: E402
from torchdata.dataloader2 import DataLoader2  # noqa: E402
from torchdata.datapipes.iter import IterableWrapper  # noqa: E402

import mprs_plus  # noqa: E402
from ray_actors import alive_actors, end_warm_actors_and_check_none_left  # noqa: E402
from mprs_plus import MultiProcessingReadingService, RayBackend  # noqa: E402
from mprs_plus.backends.ray import warm  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
DRIVER_TIMEOUT = 240
DEATH_BOUND = 20.0
# Seconds an idle actor waits in the tests that check reuse, where no actor should expire
# between its give and its take however slowly a loaded machine starts one (a pre-started
# actor's wait counts from prestart(), its start included: the default 60 s was passed on a
# loaded machine, and the loader then took a new actor). The teardown ends them all.
WARM = 600.0

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
RUNTIME_ENV = {"env_vars": {"PYTHONPATH": os.pathsep.join([TESTS, ROOT])}}


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    try:
        ray.init(address=cluster.address, runtime_env=RUNTIME_ENV, log_to_driver=False)
        yield cluster
    finally:
        warm.pool.close()
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(autouse=True)
def nothing_left(request):
    if "cluster" not in request.fixturenames:
        yield
        return
    yield
    end_warm_actors_and_check_none_left()


@pytest.mark.parametrize("bad", [-1, float("inf"), float("nan"), True, "60"])
def test_a_warm_for_that_is_not_seconds_is_refused_when_the_backend_is_made(bad):
    with pytest.raises(ValueError, match="warm_for must be a number of seconds >= 0"):
        RayBackend(warm_for=bad)


def test_prestart_needs_warm_actors_and_a_count():
    with pytest.raises(ValueError, match="needs warm_for > 0"):
        RayBackend(warm_for=0).prestart(2)
    with pytest.raises(ValueError, match="count must be an int >= 0"):
        RayBackend().prestart(-1)


def _actor_ids(loader) -> list[str]:
    runtime = loader._run.runtime if hasattr(loader, "_run") else loader.reading_service._runtime
    return [link.process.actor._actor_id.hex() for link in runtime._supervisor.topology.children()]


def _torch_epochs(backend, log, loaders=2, epochs=2):
    """Each epoch's batches of ``loaders`` loaders one after another, ``epochs`` epochs of
    ``persistent_workers=False`` each; the dataset's shift changes before every epoch."""
    import torch
    from loader_datasets import plain
    from warm_datasets import RecordsInit, Shifted

    torch.manual_seed(5)
    batches = []
    for number in range(loaders):
        dataset = Shifted(12)
        loader = mprs_plus.DataLoader(
            dataset, batch_size=3, shuffle=True, num_workers=2, backend=backend, worker_init_fn=RecordsInit(log)
        )
        for epoch in range(epochs):
            dataset.shift = 1000 * number + 100 * epoch  # the dataset as the loader holds it now
            batches.append([plain(batch) for batch in loader])
    return batches


def test_non_persistent_epochs_and_loaders_take_warm_actors_and_see_what_new_ones_see(cluster, tmp_path):
    """Two loaders of two epochs each: with warm actors, the batches (samples, worker ids,
    seeds, draws) and the worker_init_fn calls are those of new actors every epoch, and
    every epoch runs in the two actors the first one started."""
    from warm_datasets import calls

    cold_log, warm_log = str(tmp_path / "cold"), str(tmp_path / "warm")
    cold = _torch_epochs(RayBackend(num_cpus_per_worker=0, warm_for=0), cold_log)
    assert warm.pool.idle() == 0  # warm_for=0: none kept
    warmed = _torch_epochs(RayBackend(num_cpus_per_worker=0, warm_for=WARM), warm_log)
    assert warmed == cold
    shifts = sorted({int(sample[0]) // 100 * 100 for epoch in warmed for batch in epoch for sample in batch[2]})
    assert shifts == [0, 100, 1000, 1100]  # each epoch read the dataset as it was then
    cold_calls, warm_calls = calls(cold_log), calls(warm_log)
    assert sorted(c[1:] for c in warm_calls) == sorted(c[1:] for c in cold_calls)  # worker ids, draws
    assert len(warm_calls) == 8  # worker_init_fn ran again in every epoch
    assert len({pid for pid, _, _ in cold_calls}) == 8  # new actors every epoch
    assert len({pid for pid, _, _ in warm_calls}) == 2  # the same two, warm
    assert warm.pool.idle() == 2


def test_dataloader2_loaders_one_after_another_take_warm_actors(cluster, tmp_path):
    """DataLoader2: a second loader takes the first one's actors; the same items, and
    worker_init_fn runs for each loader's workers."""
    from warm_datasets import RecordsInit, calls

    def items(backend, log):
        got, ids = [], []
        for _ in range(2):
            service = MultiProcessingReadingService(2, backend=backend, worker_init_fn=RecordsInit(log))
            loader = DataLoader2(IterableWrapper(range(10)).sharding_filter().map(lambda x: x * 3), reading_service=service)
            loader.seed(1)
            try:
                got.append(list(loader))
                ids.append(sorted(_actor_ids(loader)))
            finally:
                loader.shutdown()
        return got, ids

    cold, cold_ids = items(RayBackend(num_cpus_per_worker=0, warm_for=0), str(tmp_path / "cold"))
    warmed, warm_ids = items(RayBackend(num_cpus_per_worker=0, warm_for=WARM), str(tmp_path / "warm"))
    assert warmed == cold == [[3 * x for x in range(10)]] * 2
    assert cold_ids[0] != cold_ids[1] and warm_ids[0] == warm_ids[1]
    assert sorted(w for _, w, _ in calls(str(tmp_path / "warm"))) == [0, 0, 1, 1]


def _dataloader2(backend):
    service = MultiProcessingReadingService(2, backend=backend)
    return DataLoader2(IterableWrapper(range(8)).sharding_filter(), reading_service=service)


def _listening_at(loader) -> list[tuple[str, int]]:
    """Where the workers' data channels listened (TCP), as their receivers learnt it."""
    runtime = loader.reading_service._runtime
    receivers = [receiver for _, receiver in runtime._supervisor.topology.data_receivers()]
    return [r._address(60.0) if callable(r._address) else r._address for r in receivers]


def test_an_idle_actor_that_died_is_not_handed_out_and_close_leaves_none(cluster):
    """Also: an idle actor keeps no listener of the loader before (the next one gets new
    connections, proved with its own secret)."""
    import socket

    backend = RayBackend(num_cpus_per_worker=0, warm_for=WARM)
    loader = _dataloader2(backend)
    assert list(loader) == list(range(8))
    first = set(_actor_ids(loader))
    addresses = _listening_at(loader)
    loader.shutdown()
    assert warm.pool.idle() == 2
    for address in addresses:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(address, timeout=30).close()
    victim = next(entry.actor for entries in warm.pool._idle.values() for entry in entries)
    ray.kill(victim, no_restart=True)
    # Ray has it dead now (a call sent right after the kill may still be answered: probed
    # until one fails); the pool does not know
    assert warm.wait_dead(victim, time.monotonic() + DEATH_BOUND)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(victim.where.remote(), timeout=60)
    loader = _dataloader2(backend)
    try:
        assert list(loader) == list(range(8))
        now = set(_actor_ids(loader))
    finally:
        loader.shutdown()
    assert victim._actor_id.hex() not in now  # replaced by a new one
    assert len(now & first) == 1  # the one alive was taken
    assert warm.pool.idle() == 2
    backend.close()
    assert warm.pool.idle() == 0 and alive_actors() == []


def test_prestarted_actors_are_the_ones_the_loader_takes(cluster):
    backend = RayBackend(num_cpus_per_worker=0, warm_for=WARM)
    backend.prestart(2)
    started = {entry.actor._actor_id.hex() for entries in warm.pool._idle.values() for entry in entries}
    assert len(started) == 2
    loader = _dataloader2(backend)
    try:
        assert list(loader) == list(range(8))
        assert set(_actor_ids(loader)) == started
    finally:
        loader.shutdown()
    backend.close()
    assert alive_actors() == []


def test_idle_actors_end_after_warm_for(cluster):
    backend = RayBackend(num_cpus_per_worker=0, warm_for=0.5)
    loader = _dataloader2(backend)
    assert list(loader) == list(range(8))
    loader.shutdown()
    deadline = time.monotonic() + DEATH_BOUND
    while (warm.pool.idle() or alive_actors()) and time.monotonic() < deadline:
        time.sleep(0.2)  # polling Ray's state: nothing to be woken by
    assert warm.pool.idle() == 0 and alive_actors() == []


DRIVER = textwrap.dedent(
    """
    import sys, time
    import ray, mprs_plus
    from torchdata.dataloader2 import DataLoader2
    from torchdata.datapipes.iter import IterableWrapper
    from mprs_plus.backends.ray import warm

    ray.init(address=sys.argv[1], log_to_driver=False)
    service = mprs_plus.MultiProcessingReadingService(2, backend=mprs_plus.RayBackend(num_cpus_per_worker=0))
    loader = DataLoader2(IterableWrapper(range(6)).sharding_filter(), reading_service=service)
    assert list(loader) == list(range(6))
    loader.shutdown()
    print("idle", warm.pool.idle(), flush=True)
    time.sleep(120)  # killed by the test long before
    """
)


def test_a_driver_killed_by_sigkill_leaves_no_warm_actor(cluster):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, ROOT]))
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, cluster.address], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    try:
        line = []
        reader = threading.Thread(target=lambda: line.append(driver.stdout.readline()), daemon=True)
        reader.start()
        reader.join(DRIVER_TIMEOUT)
        assert line and line[0].split() == ["idle", "2"], line
        assert len(alive_actors()) == 2  # the driver's idle actors
        driver.kill()
        driver.wait(30)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(30)
    deadline = time.monotonic() + DEATH_BOUND
    while alive_actors() and time.monotonic() < deadline:
        time.sleep(0.2)  # polling Ray's state: nothing to be woken by
    assert alive_actors() == []


def test_a_warm_actor_killed_in_epoch_two_is_replaced_and_the_batches_are_torchs(cluster, tmp_path):
    """Epoch 2 of persistent_workers=False runs in epoch 1's actors; one of them dies deep
    into it: a new actor replaces it and the loop gets torch's batches. The dead one is
    not given back; the replacement is."""
    import torch
    from loader_datasets import plain
    from restart_datasets import Draws

    def epochs(loader_class, dataset, **kwargs):
        torch.manual_seed(0)
        loader = loader_class(dataset, batch_size=4, num_workers=2, **kwargs)
        got = [[plain(batch) for batch in loader]]
        open(armed, "w").close()  # the kill happens in epoch 2 only
        got.append([plain(batch) for batch in loader])
        return got, loader

    armed, marker = str(tmp_path / "armed"), str(tmp_path / "killed")
    expected, _ = epochs(torch.utils.data.DataLoader, Draws(n=64), multiprocessing_context="forkserver")
    os.remove(armed)
    backend = RayBackend(num_cpus_per_worker=0, warm_for=WARM)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, loader = epochs(mprs_plus.DataLoader, Draws(n=64, kill_at=41, marker=marker, armed=armed), backend=backend, worker_restarts=1)
        stats = loader.stats()
    assert os.path.exists(marker)  # the death happened
    assert got == expected
    # Sample 41 is in batch 10: worker 0's; the epoch is the first of epoch 2's own runtime.
    assert [(made.worker, made.epoch) for made in stats.replacements] == [(0, 1)]
    assert any("A new worker replaces" in str(w.message) for w in caught)
    assert warm.pool.idle() == 2  # the survivor and the replacement; not the dead one
