"""``SharedList``: a read-only Sequence whose items live once in shared memory, handed to
other processes as a handle (fork, spawn, forkserver; torch's DataLoader, ours, the
reading service), and freed with its last holder, whoever dies how."""

from __future__ import annotations

import collections.abc
import os
import pickle
import subprocess
import sys
import tempfile

import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader

import mprs_plus
import pipelines
from mprs_plus import SharedList

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def records(n):
    return [{"path": f"/data/{i:07d}.jpg", "label": i % 10, "box": (i, i + 1, 4, 4)} for i in range(n)]


def test_it_reads_as_the_list_it_was_built_from():
    source = records(50)
    shared = SharedList(source)
    assert isinstance(shared, collections.abc.Sequence)
    assert len(shared) == 50
    assert shared[0] == source[0] and shared[49] == source[49]
    assert shared[-1] == source[-1] and shared[-50] == source[0]
    assert list(shared) == source
    assert list(reversed(shared)) == source[::-1]
    assert source[7] in shared and {"path": "elsewhere"} not in shared
    assert shared.index(source[7]) == 7 and shared.count(source[7]) == 1
    for bad in (50, -51, 10**9):
        with pytest.raises(IndexError, match="out of range"):
            shared[bad]
    with pytest.raises(TypeError):
        shared["0"]
    assert list(SharedList()) == [] and len(SharedList(iter([]))) == 0
    assert list(SharedList(x for x in range(5))) == [0, 1, 2, 3, 4]  # any iterable, once


def test_a_slice_is_a_view_of_the_same_block_with_list_semantics():
    source = records(30)
    shared = SharedList(source)
    for cut in (slice(3, 9), slice(None, None, -2), slice(-5, None), slice(20, 5, -3), slice(40, 50)):
        view = shared[cut]
        assert isinstance(view, SharedList)
        assert list(view) == source[cut] and len(view) == len(source[cut])
        assert view.nbytes == shared.nbytes  # no copy: the same block
    assert shared[2:20][3:6][-1] == source[2:20][3:6][-1]
    with pytest.raises(IndexError):
        shared[3:9][6]


def test_where_shared_memory_takes_no_write_it_is_built_in_one_copy(monkeypatch):
    # As macOS's POSIX shared memory: no write(), sized once at its creation.
    from mprs_plus import shared_list

    def refuse(self, view):
        raise OSError(6, "Device not configured")

    monkeypatch.setattr(shared_list._Writer, "_write", refuse)
    source = records(3000)
    shared = SharedList(source)
    assert list(shared) == source and shared[-1] == source[-1]
    assert pickle.loads(pickle.dumps(shared))[1234] == source[1234]


def test_every_access_is_a_fresh_copy_and_nothing_stored_changes():
    shared = SharedList([{"labels": [1, 2]}])
    item = shared[0]
    item["labels"].append(3)
    item["new"] = True
    assert shared[0] == {"labels": [1, 2]}
    assert shared[0] is not shared[0]
    assert next(iter(shared)) == {"labels": [1, 2]}
    with pytest.raises(TypeError):
        shared[0] = {}  # read-only: no __setitem__


def test_it_pickles_as_a_handle_whose_size_does_not_depend_on_the_data():
    small, large = SharedList(records(10)), SharedList(records(100_000))
    assert large.nbytes > 5_000_000
    small_pickle, large_pickle = pickle.dumps(small), pickle.dumps(large)
    assert len(large_pickle) < 1000
    assert abs(len(large_pickle) - len(small_pickle)) < 16  # digits of the counts, nothing more
    copy = pickle.loads(large_pickle)
    assert len(copy) == 100_000 and copy[-1] == records(100_000)[-1]
    assert pickle.loads(pickle.dumps(large[10:20]))[0] == large[10]


def _read_in_child(shared, index, conn):
    conn.send((len(shared), shared[index], sum(item["label"] for item in shared[::7])))


def _expected(source, index):
    return (len(source), source[index], sum(item["label"] for item in source[::7]))


def test_workers_of_every_start_method_map_it(start_method):
    import multiprocessing

    source = records(2_000)
    shared = SharedList(source)
    ctx = multiprocessing.get_context(start_method)
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_read_in_child, args=(shared, -3, send))  # in the start arguments
    child.start()
    send.close()
    assert receive.poll(60)
    assert receive.recv() == _expected(source, -3)
    child.join(30)
    assert child.exitcode == 0


def test_a_process_not_started_with_it_maps_it_through_the_holder():
    import multiprocessing

    source = records(500)
    shared = SharedList(source)
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # arguments sent after the start
        assert pool.apply(len, (shared,)) == 500
        assert pool.apply(SharedList.__getitem__, (shared[100:], 5)) == source[105]


def test_unpickling_after_the_holder_is_gone_says_what_to_do():
    code = (
        "import pickle, sys; from mprs_plus import SharedList; "
        "sys.stdout.buffer.write(pickle.dumps(SharedList(range(1000))))"
    )
    env = dict(os.environ, PYTHONPATH=ROOT)
    data = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, check=True, timeout=60).stdout
    with pytest.raises(RuntimeError, match="SharedList of 1,000 items cannot be mapped here: .*keep the process"):
        pickle.loads(data)


def test_a_pickle_that_may_cross_machines_carries_the_bytes_and_reads_without_the_holder():
    # As in a Ray cluster of several nodes; read here after its holder exited, as on another node.
    code = (
        "import pickle, sys; import mprs_plus.shared_list as m; m._other_machines_may_read = lambda: True; "
        "s = m.SharedList({'label': i} for i in range(1000)); data = pickle.dumps(s[::-1]); "
        "assert len(data) > s.nbytes; sys.stdout.buffer.write(data)"
    )
    env = dict(os.environ, PYTHONPATH=ROOT)
    data = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, check=True, timeout=60).stdout
    copy = pickle.loads(data)
    assert len(copy) == 1000 and copy[0] == {"label": 999} and list(copy[:3]) == [{"label": i} for i in (999, 998, 997)]
    again = pickle.loads(pickle.dumps(copy[1:]))  # a copy pickles with its bytes again
    assert again[0] == {"label": 998} and again.nbytes == copy.nbytes


def _leftovers():
    """Entries of the places a named block could be left in, under the names it would have."""
    found = set()
    for folder, prefix in (("/dev/shm", "mprs_"), (tempfile.gettempdir(), "mprs_plus-")):
        try:
            found |= {os.path.join(folder, name) for name in os.listdir(folder) if name.startswith(prefix)}
        except FileNotFoundError:
            pass
    return found


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
@pytest.mark.parametrize("kind", ["memfd", "shm", "file"])
def test_a_sigkilled_creator_leaves_nothing_and_its_spawned_child_still_reads(kind, method):
    before = _leftovers()
    env = dict(os.environ, PYTHONPATH=ROOT, MPRS_PLUS_LEND_MEMORY=kind)
    script = os.path.join(ROOT, "tests", "shared_list_script.py")
    # The run ends when its stdout closes: when the killed creator and its orphaned child are both gone.
    result = subprocess.run(
        [sys.executable, script, "20000", method], capture_output=True, text=True, env=env, timeout=90
    )
    assert result.returncode == -9, result.stderr
    assert result.stdout.split("\n")[:3] == ["built", "parent gone", f"read {sum(range(20000))}"], result.stderr
    assert _leftovers() - before == set()


# Under each loader a worker gets the list inherited (fork) or pickled as a handle
# (forkserver, as spawn does); every start method maps it in the cases above, whose subject
# is the start method. Spawn here would add a fresh interpreter importing torch per worker.
@pytest.mark.parametrize("start_method", pipelines.INHERITED_AND_PICKLED)
@pytest.mark.parametrize("workers", [0, 2])
def test_torchs_dataloader_over_it(start_method, workers):
    source = records(64)
    shared = SharedList(source)
    loader = TorchDataLoader(
        shared,
        batch_size=8,
        shuffle=False,
        num_workers=workers,
        multiprocessing_context=start_method if workers else None,
    )
    batches = list(loader)
    expected = list(TorchDataLoader(source, batch_size=8, shuffle=False))
    assert len(batches) == 8
    for got, want in zip(batches, expected):
        assert got["path"] == want["path"]
        assert torch.equal(got["label"], want["label"])


@pytest.mark.parametrize("start_method", pipelines.INHERITED_AND_PICKLED)
def test_mprs_plus_dataloader_over_it(start_method):
    source = records(64)
    shared = SharedList(source)
    loader = mprs_plus.DataLoader(
        shared, batch_size=8, shuffle=True, num_workers=2, multiprocessing_context=start_method,
        generator=torch.Generator().manual_seed(5),
    )
    reference = TorchDataLoader(source, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(5))
    got, want = list(loader), list(reference)
    assert [b["path"] for b in got] == [b["path"] for b in want]
    del loader


def _label(record):
    return record["label"]


@pytest.mark.parametrize("start_method", pipelines.INHERITED_AND_PICKLED)
def test_the_reading_service_over_an_iterable_wrapper_of_it(start_method):
    from torchdata.dataloader2 import DataLoader2
    from torchdata.datapipes.iter import IterableWrapper

    source = records(40)
    pipe = IterableWrapper(SharedList(source)).sharding_filter().map(_label)
    service = mprs_plus.MultiProcessingReadingService(num_workers=2, multiprocessing_context=start_method)
    loader = DataLoader2(pipe, reading_service=service)
    try:
        assert sorted(loader) == sorted(r["label"] for r in source)
    finally:
        loader.shutdown()
