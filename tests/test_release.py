"""``shutdown()`` lets go of every mapping and descriptor the service owns; the shared
memory of items the user still holds goes when the last of them is dropped, not when the
DataLoader2 object dies, and a shut-down loader that is still referenced holds nothing.

What is measured: the channels' mappings (``/proc/self/maps``, the memfds are named
"mprs_plus channel"), this process's shared memory resident (``RssShmem``) and its open
descriptors, each against a baseline taken after a first loader ran (the first one
creates what lives as long as the process: multiprocessing's shared heap, for one)."""

from __future__ import annotations

import functools
import gc
import os

import pytest
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

import pipelines
from mprs_plus import MultiProcessingReadingService

MIB = 1 << 20


def channel_mappings() -> tuple[int, int]:
    """(count, bytes) of this process's mappings of the service's channels."""
    count = size = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "mprs_plus channel" in line:
                start, end = line.split()[0].split("-")
                count += 1
                size += int(end, 16) - int(start, 16)
    return count, size


def rss_shmem() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem in /proc/self/status")


def descriptors() -> int:
    """This process's descriptors, less those open on /proc and /sys: a thread that samples
    memory (``worker_restarts``' memory watch, the statistics) holds one for a moment, so
    their count depends on when the snapshot falls, not on what the service let go of."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (the listing's own descriptor among them)
            continue
        if not target.startswith(("/proc/", "/sys/")):
            count += 1
    return count


def snapshot() -> tuple[tuple[int, int], int]:
    gc.collect()
    return channel_mappings(), descriptors()


def loader_of(n: int, numel: int, start_method: str, dispatch: bool = False) -> DataLoader2:
    pipe = IterableWrapper(range(n))
    if dispatch:
        pipe = pipe.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    else:
        pipe = pipe.sharding_filter()
    pipe = pipe.map(functools.partial(pipelines.filled_tensor, numel=numel))
    return DataLoader2(pipe, reading_service=MultiProcessingReadingService(2, multiprocessing_context=start_method))


@pytest.fixture
def baseline(start_method):
    """What this process holds once a loader has come and gone."""
    warm = loader_of(4, 16, start_method)
    list(warm)
    warm.shutdown()
    del warm
    return snapshot()


# Children inherited (fork) and pickled (forkserver, as spawn does), each with and without
# a dispatch process. What is checked lives in this process, where the start method changes
# only how the children were launched; that spawn's launch leaves no descriptor or segment
# here is forced by the transport's own process tests, each start method in turn.
PAIRS = [(method, dispatch) for method in pipelines.INHERITED_AND_PICKLED for dispatch in (False, True)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "start_method, dispatch", PAIRS, ids=[f"{m}-{'dispatched' if d else 'sharded'}" for m, d in PAIRS]
)
def test_the_usual_loop_leaves_nothing_once_its_last_item_is_dropped(start_method, baseline, dispatch):
    loader = loader_of(40, MIB // 4, start_method, dispatch)  # 1 MiB tensors: lent
    for item in loader:
        assert float(item[0]) == float(item[-1])
    loader.shutdown()
    assert channel_mappings()[0] == 1  # the last item's channel, mapped for it alone
    assert float(item.sum()) == float(item[0]) * item.numel()  # and intact
    del item
    assert snapshot() == baseline  # the loader is still referenced
    del loader
    assert snapshot() == baseline


@pytest.mark.timeout(240)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_kept_items_hold_their_memory_until_the_last_is_dropped(start_method, baseline):
    """200 kept 4 MiB items: the views among them keep their channels mapped after
    shutdown, and their memory (read whole here, so that this process maps every page of
    them); dropping them unmaps everything, the loader still referenced."""
    loader = loader_of(260, MIB, start_method)
    kept = [item for _, item in zip(range(200), loader)]
    loader.shutdown()
    assert all(bool((item == i).all()) for i, item in enumerate(kept))
    assert channel_mappings()[0] == 2 and rss_shmem() > 64 * MIB
    del kept
    assert snapshot() == baseline
    assert rss_shmem() < 16 * MIB
    del loader


@pytest.mark.parametrize("start_method", pipelines.INHERITED_AND_PICKLED)
@pytest.mark.timeout(180)
def test_shut_down_loaders_that_are_kept_hold_no_descriptor(start_method, baseline):
    loaders = []
    for round in range(2):  # one sharded, one with a dispatch process
        loader = loader_of(8, 16, start_method, dispatch=round % 2 == 1)
        assert len(list(loader)) == 8
        loader.shutdown()
        loaders.append(loader)
    assert snapshot() == baseline
    del loaders, loader
    assert snapshot() == baseline
