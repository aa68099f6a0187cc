"""Every combination users hit: start method x dispatcher x epochs x seeds, against
torchdata's own service; and the awkward datasets (a MapDataPipe, an empty one, fewer
items than workers, uneven shards)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import warnings

import pytest
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.map import SequenceWrapper

import pipelines
from mprs_plus import MultiProcessingReadingService

from torchdata_reference import N, SEEDS, epochs_with_seeds  # epoch 1 with the first seed, epoch 2 with the second


@pytest.fixture(scope="module")
def torchdata_outputs():
    """torchdata's service on the same pipelines and seeds, run in a process of its own."""
    script = pathlib.Path(__file__).with_name("torchdata_reference.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(script.parent.parent), str(script.parent)])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


# Every start method, with and without a dispatch process, in four pairs: spawn's and
# forkserver's children both receive their segment pickled, so each pairing is covered.
PAIRS = [("fork", False), ("fork", True), ("spawn", True), ("forkserver", False)]


@pytest.mark.parametrize(
    "start_method, dispatch", PAIRS, ids=[f"{m}-{'dispatch' if d else 'no_dispatch'}" for m, d in PAIRS]
)
def test_start_methods_dispatch_epochs_seeds_match_torchdata(start_method, dispatch, torchdata_outputs):
    ours = epochs_with_seeds(
        pipelines.matrix_pipe(N, dispatch), MultiProcessingReadingService(2, multiprocessing_context=start_method)
    )
    for epoch in ours:
        assert sorted(epoch) == [2 * i for i in range(N)]
    assert ours[0] != ours[1]  # different seeds, different shuffles
    # With a fixed seed, the seed generator moves on only through random DataPipes of the
    # main process (none here): torchdata and we both repeat the epoch.
    assert ours[2] == ours[1]
    assert ours == torchdata_outputs["dispatch" if dispatch else "no_dispatch"]


def run(datapipe, **options):
    options.setdefault("num_workers", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loader = DataLoader2(datapipe, reading_service=MultiProcessingReadingService(**options))
    try:
        return [list(loader) for _ in range(2)]
    finally:
        loader.shutdown()


@pytest.mark.parametrize("in_order", [True, False], ids=["in_order", "as_ready"])
@pytest.mark.parametrize("dispatch", [False, True], ids=["no_dispatch", "dispatch"])
@pytest.mark.parametrize(
    "items, num_workers, expected",
    [
        ([], 2, []),
        ([5, 6], 3, [10, 12]),  # fewer items than workers
        (list(range(7)), 3, [0, 2, 4, 6, 8, 10, 12]),  # shards of 3, 2 and 2 items
    ],
    ids=["empty", "fewer_items_than_workers", "uneven_shards"],
)
def test_awkward_datasets(items, num_workers, expected, dispatch, in_order):
    epochs = run(pipelines.plain_pipe(items, dispatch), num_workers=num_workers, in_order=in_order)
    for epoch in epochs:
        assert (epoch if in_order else sorted(epoch)) == expected


def test_a_map_datapipe_input_behaves_as_with_torchdata(torchdata_outputs):
    """DataLoader2 turns a MapDataPipe into an IterDataPipe before any service sees it;
    without a sharding point every worker yields all of it, as with torchdata (we warn)."""
    pipe = SequenceWrapper(range(5)).map(pipelines.double)
    with pytest.warns(UserWarning, match="No sharding point"):
        loader = DataLoader2(pipe, reading_service=MultiProcessingReadingService(2))
        try:
            ours = list(loader)
        finally:
            loader.shutdown()
    assert ours == torchdata_outputs["map_datapipe"] == [0, 0, 2, 2, 4, 4, 6, 6, 8, 8]


@pytest.mark.parametrize("dispatch", [False, True], ids=["no_dispatch", "dispatch"])
def test_a_map_datapipe_shuffled_then_split(dispatch):
    pipe = SequenceWrapper(range(9)).map(pipelines.double).shuffle()  # a MapDataPipe, then an IterDataPipe
    if dispatch:
        pipe = pipe.sharding_round_robin_dispatch(pipelines.SHARDING_PRIORITIES.MULTIPROCESSING).map(pipelines.identity)
    else:
        pipe = pipe.sharding_filter()
    first = epochs_with_seeds(pipe, MultiProcessingReadingService(2))
    again = epochs_with_seeds(pipe, MultiProcessingReadingService(2))
    assert first == again and first[0] != first[1]
    assert all(sorted(epoch) == [2 * i for i in range(9)] for epoch in first)
