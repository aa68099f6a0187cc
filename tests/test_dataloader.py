"""mprs_plus.DataLoader side by side with torch's own DataLoader: the same batches for the
same seed (worker randomness included), torch's worker protocol, its errors, a clean end."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import warnings

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import BatchSampler, Dataset, SequentialSampler, get_worker_info
from torch.utils.data import DataLoader as TorchDataLoader

from mprs_plus import DataLoader
from loader_datasets import Nested, Ragged, Randomized, Ranges, add_one, gen, nest, plain, rows, run, sum_collate

pytestmark = pytest.mark.timeout(120)

CASES = {
    "sequential": lambda cls, w: cls(Randomized(), batch_size=4, num_workers=w),
    "shuffle": lambda cls, w: cls(Randomized(), batch_size=4, shuffle=True, num_workers=w),
    "shuffle_generator": lambda cls, w: cls(Randomized(), batch_size=3, shuffle=True, num_workers=w, generator=gen()),
    "drop_last": lambda cls, w: cls(Randomized(), batch_size=5, shuffle=True, drop_last=True, num_workers=w),
    "batch_sampler": lambda cls, w: cls(
        Randomized(), batch_sampler=BatchSampler(SequentialSampler(range(23)), 6, False), num_workers=w
    ),
    "no_batching": lambda cls, w: cls(Randomized(7), batch_size=None, shuffle=True, num_workers=w),
    "collate_fn": lambda cls, w: cls(Randomized(), batch_size=4, collate_fn=sum_collate, num_workers=w),
    "worker_init_fn": lambda cls, w: cls(
        Randomized(), batch_size=4, num_workers=w, worker_init_fn=add_one if w else None
    ),
    "nested": lambda cls, w: cls(Nested(), batch_size=4, num_workers=w),
}


@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_same_batches_as_torch(case, workers):
    make = CASES[case]
    expected = run(TorchDataLoader, lambda cls: make(cls, workers))
    assert run(DataLoader, lambda cls: make(cls, workers)) == expected


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("batching", ["none", "collate_fn"])
def test_nested_tensors_arrive_as_with_torch(workers, batching):
    """Nested tensors (small, and over the shared-memory size) cross as torch's own
    reduction sends them: no single shape or storage to lend."""
    options = {"batch_size": None} if batching == "none" else {"batch_size": 2, "collate_fn": nest}

    def epoch(cls):
        return [rows(batch) for batch in cls(Ragged(), num_workers=workers, **options)]

    ours = epoch(DataLoader)
    assert ours == epoch(TorchDataLoader)
    assert len(ours) == (7 if batching == "none" else 4) and len(ours[0][0]) == 40_000


@pytest.mark.parametrize("workers", [1, 2])
def test_persistent_workers_keep_their_processes_and_generators(workers):
    def make(cls):
        return cls(Randomized(), batch_size=4, shuffle=True, num_workers=workers, persistent_workers=True)

    assert run(DataLoader, make, epochs=3) == run(TorchDataLoader, make, epochs=3)

    class Pid(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return os.getpid()

    loader = DataLoader(Pid(), batch_size=2, num_workers=workers, persistent_workers=True)
    first = {int(p) for batch in loader for p in batch}
    second = {int(p) for batch in loader for p in batch}
    assert first == second and os.getpid() not in first


def test_iterable_dataset_replicas_interleave_as_torch():
    for workers in (0, 1, 2):
        for kwargs in ({"batch_size": 2}, {"batch_size": 3, "drop_last": True}, {"batch_size": None}):

            def make(cls, kwargs=kwargs, workers=workers):
                return cls(Ranges(), num_workers=workers, **kwargs)

            assert run(DataLoader, make) == run(TorchDataLoader, make), (workers, kwargs)


def test_in_order_false_yields_every_batch_once():
    loader = DataLoader(Randomized(), batch_size=2, num_workers=2, in_order=False)
    indices = sorted(i for batch in loader for i in batch["index"].tolist())
    assert indices == list(range(23))


def test_worker_info_is_none_in_the_main_process_and_set_in_workers():
    assert get_worker_info() is None
    seen = {(b["worker"].tolist()[0], b["seed"].tolist()[0]) for b in DataLoader(Randomized(8), batch_size=2, num_workers=2)}
    torch.manual_seed(1)
    base = torch.empty((), dtype=torch.int64).random_().item()
    assert {w for w, _ in seen} == {0, 1}
    torch.manual_seed(1)
    seeds = {w: s for w, s in {(b["worker"].tolist()[0], b["seed"].tolist()[0]) for b in DataLoader(Randomized(8), batch_size=2, num_workers=2)}}
    assert seeds == {0: base, 1: base + 1}
    assert get_worker_info() is None


def test_start_methods(start_method):
    def make(cls):
        return cls(Randomized(9), batch_size=2, shuffle=True, num_workers=2, multiprocessing_context=start_method)

    assert run(DataLoader, make, epochs=1) == run(TorchDataLoader, make, epochs=1)


def test_constructor_and_attributes_are_torchs():
    dataset = Randomized()
    ours, theirs = DataLoader(dataset, batch_size=4, shuffle=True, num_workers=2), TorchDataLoader(
        dataset, batch_size=4, shuffle=True, num_workers=2
    )
    assert isinstance(ours, TorchDataLoader)
    for name in ("dataset", "batch_size", "drop_last", "num_workers", "prefetch_factor", "pin_memory", "timeout",
                 "worker_init_fn", "persistent_workers", "in_order", "generator", "pin_memory_device"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert type(ours.sampler) is type(theirs.sampler) and type(ours.batch_sampler) is type(theirs.batch_sampler)
    assert len(ours) == len(theirs) == 6
    assert len(iter(ours)) == 6
    with pytest.raises(ValueError, match="prefetch_factor"):
        DataLoader(dataset, prefetch_factor=2)
    with pytest.raises(ValueError, match="persistent_workers"):
        DataLoader(dataset, persistent_workers=True)
    with pytest.raises(ValueError, match="should not be set"):
        ours.batch_size = 3
    with pytest.raises(TypeError):
        len(DataLoader(Ranges()))


def test_recreated_as_libraries_do():
    """Lightning and Accelerate re-create a loader from its attributes with a new sampler."""
    loader = DataLoader(Randomized(), batch_size=4, num_workers=1, collect_stats=False, snapshot_every_n_steps=3)
    sampler = torch.utils.data.distributed.DistributedSampler(loader.dataset, num_replicas=2, rank=1, shuffle=False)
    again = type(loader)(
        loader.dataset, batch_size=loader.batch_size, sampler=sampler, num_workers=loader.num_workers,
        collate_fn=loader.collate_fn, collect_stats=loader.collect_stats, device=loader.device,
        backend=loader.backend, snapshot_every_n_steps=loader.snapshot_every_n_steps,
    )
    indices = [i for batch in again for i in batch["index"].tolist()]
    assert indices == list(sampler)


# -- errors and lifecycle ----------------------------------------------------------------


class FailsAt(Dataset):
    def __init__(self, bad):
        self.bad = bad

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"bad sample {i}")
        return i


def test_a_worker_exception_is_raised_as_torch_raises_it():
    def first_error(loader):
        # Caught here and let go: the epoch's iterator, in the traceback's frames, goes with
        # it, and its workers too (the leak check looks).
        try:
            list(loader)
        except Exception as exc:
            return type(exc), str(exc)
        return None

    kind, text = first_error(DataLoader(FailsAt(3), batch_size=2, num_workers=2))
    assert kind is ValueError
    assert text.startswith("Caught ValueError in DataLoader worker process 1.\nOriginal Traceback (most recent call last):")
    assert "bad sample 3" in text and "__getitem__" in text


def test_an_exception_without_workers_is_the_original():
    with pytest.raises(ValueError, match="^bad sample 3$"):
        list(DataLoader(FailsAt(3), batch_size=2))


class KillsItself(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 4:
            os.kill(os.getpid(), signal.SIGKILL)
        return i


def test_a_killed_worker_is_a_runtime_error_naming_its_pid():
    loader = DataLoader(KillsItself(), batch_size=2, num_workers=2)
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid \d+\) is killed by signal: Killed") as caught:
        list(loader)
    assert type(caught.value) is RuntimeError


class Stalls(Dataset):
    def __init__(self):
        self.never = threading.Event()

    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i == 2:
            self.never.wait(60)
        return i

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.never = threading.Event()


def test_timeout_is_a_runtime_error(short_stop_grace):
    loader = DataLoader(Stalls(), batch_size=1, num_workers=1, timeout=1)
    with pytest.raises(RuntimeError, match="DataLoader timed out after 1 seconds") as caught:
        list(loader)
    assert type(caught.value) is RuntimeError


def test_break_and_del_leave_nothing():
    # the no_leaks fixture checks that no process nor shared memory is left
    loader = DataLoader(Randomized(), batch_size=2, num_workers=2)
    for _ in loader:
        break
    loader = DataLoader(Randomized(), batch_size=2, num_workers=2, persistent_workers=True)
    for _ in loader:
        break
    del loader


def test_persistent_workers_end_with_their_loader_while_their_runtime_is_held_elsewhere():
    """A traceback kept in a reference cycle holds whatever its frames held (the runtime, a
    reader of it) until Python's collector runs. The loader's own end must stop the workers
    all the same, at ``del``, as torch's do: here the runtime is held on purpose."""
    loader = DataLoader(Randomized(), batch_size=2, num_workers=2, persistent_workers=True)
    for _ in loader:
        break
    runtime = loader._run.runtime
    children = [psutil.Process(link.process.pid) for link in runtime._topology.started()]
    assert len(children) == 2 and all(child.is_running() for child in children)
    del loader  # ``runtime`` still holds the service: only the loader's end can stop it
    assert runtime.lifecycle.closed
    _, alive = psutil.wait_procs(children, timeout=10)
    assert alive == []


def test_interpreter_exit_mid_epoch_leaves_nothing(tmp_path):
    script = tmp_path / "exit_mid_epoch.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, torch
            from mprs_plus import DataLoader
            loader = DataLoader(torch.arange(1000).reshape(100, 10), batch_size=2, num_workers=2, persistent_workers=True)
            it = iter(loader)
            next(it)
            print(*(link.process.pid for link in loader._run.runtime._topology.started()), flush=True)
            sys.exit(0)
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    pids = [int(pid) for pid in done.stdout.split()]
    assert len(pids) == 2
    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(processes, timeout=10)
    assert not alive


def test_nothing_about_deprecated_datapipes_is_printed(tmp_path):
    """Neither in the main process nor in a worker, under any start method: this path does
    not load torchdata, whose DataPipes print a deprecation banner when first imported."""
    script = tmp_path / "quiet.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, torch
            from mprs_plus import DataLoader
            if __name__ == "__main__":
                for method in ("fork", "spawn", "forkserver"):
                    loader = DataLoader(torch.arange(6), batch_size=3, num_workers=2, multiprocessing_context=method)
                    assert [b.tolist() for b in loader] == [[0, 1, 2], [3, 4, 5]]
                print(sorted(name for name in sys.modules if name.startswith("torchdata")))
            """
        )
    )
    done = subprocess.run([sys.executable, "-W", "default", str(script)], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    assert "deprecated" not in done.stderr and "WARNING!" not in done.stderr, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("workers", [0, 2])
def test_samplers_without_len_even_infinite(workers):
    import itertools

    from loader_datasets import Endless, Unsized

    def endless(cls):
        torch.manual_seed(7)
        random.seed(7)
        np.random.seed(7)
        loader = cls(Randomized(), batch_size=3, sampler=Endless(23), num_workers=workers)
        epochs = [[plain(b) for b in itertools.islice(loader, 7)] for _ in range(2)]
        return epochs, torch.rand(1).item()  # the main process's generator moved as torch's

    assert endless(DataLoader) == endless(TorchDataLoader)

    def finite(cls):
        return cls(Randomized(), batch_size=4, sampler=Unsized(23, 5), num_workers=workers)

    assert run(DataLoader, finite) == run(TorchDataLoader, finite)


@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize("persistent", [False, True])
def test_a_datapipe_dataset_is_sharded_and_seeded_as_torch_does(workers, persistent):
    from loader_datasets import datapipe

    if persistent and not workers:
        pytest.skip("persistent workers need workers")

    def make(cls):
        return cls(datapipe(), batch_size=3, num_workers=workers, persistent_workers=persistent)

    assert run(DataLoader, make, epochs=3) == run(TorchDataLoader, make, epochs=3)


def test_a_loader_in_a_reference_cycle_is_stopped_by_the_garbage_collector():
    import gc

    loader = DataLoader(Randomized(), batch_size=2, num_workers=2, persistent_workers=True)
    loader.myself = loader  # a cycle: only the garbage collector frees it
    batches = iter(loader)
    next(batches)
    pids = [link.process.pid for link in loader._run.runtime._topology.started()]
    del batches, loader
    gc.collect()
    _, alive = psutil.wait_procs([psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)], timeout=10)
    assert not alive


def test_a_context_object_as_multiprocessing_context():
    import multiprocessing

    def make(cls):
        # Not fork, the default: the loader uses the object it was given. Forkserver starts
        # its workers as spawn does, without an interpreter importing torch for each.
        context = multiprocessing.get_context("forkserver")
        return cls(Randomized(6), batch_size=2, num_workers=2, multiprocessing_context=context)

    assert run(DataLoader, make, epochs=1) == run(TorchDataLoader, make, epochs=1)


class FailsOnce(Dataset):
    """Sample 3 fails in the first epoch only (the flag lives in the persistent worker)."""

    def __init__(self):
        self.failed = False

    def __len__(self):
        return 6

    def __getitem__(self, i):
        if i == 3 and not self.failed:
            self.failed = True
            raise KeyError(i)
        return i


def test_persistent_workers_go_on_after_an_exception_in_a_worker():
    loader = DataLoader(FailsOnce(), batch_size=2, num_workers=2, persistent_workers=True)
    with pytest.raises(KeyError, match="Caught KeyError in DataLoader worker process 1"):
        list(loader)
    pids = {link.process.pid for link in loader._run.runtime._topology.started()}
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3], [4, 5]]
    assert {link.process.pid for link in loader._run.runtime._topology.started()} == pids


def test_two_iterators_of_one_loader_run_side_by_side():
    """Without persistent workers each iterator has its own workers, as with torch."""
    loader = DataLoader(Randomized(8), batch_size=2, num_workers=2)
    pairs = [(a["index"].tolist(), b["index"].tolist()) for a, b in zip(loader, loader)]
    assert pairs == [([0, 1], [0, 1]), ([2, 3], [2, 3]), ([4, 5], [4, 5]), ([6, 7], [6, 7])]


def outcomes(loader):
    """Each next() of an epoch: the batch, or the exception's type and first line."""
    found, batches = [], iter(loader)
    while True:
        try:
            found.append(next(batches).tolist())
        except StopIteration:
            return found
        except Exception as exc:
            found.append((type(exc).__name__, str(exc).splitlines()[0]))


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_goes_on_after_a_batch_that_raised(workers):
    class Every3rd(Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            if i % 5 == 3:
                raise ValueError(f"bad sample {i}")
            return i

    def make(cls):
        return cls(Every3rd(), batch_size=2, num_workers=workers)

    ours, theirs = outcomes(make(DataLoader)), outcomes(make(TorchDataLoader))
    assert ours == theirs
    assert ours[1] == ("ValueError", "Caught ValueError in DataLoader worker process 1." if workers else "bad sample 3")


class SharedCounter(Dataset):
    """Holds a multiprocessing lock and counter, as datasets that synchronize their workers
    do: objects that only cross to a child by inheritance or at its start, never copied."""

    def __init__(self):
        import multiprocessing

        self.count = multiprocessing.get_context("fork").Value("i", 0)

    def __len__(self):
        return 6

    def __getitem__(self, i):
        with self.count.get_lock():
            self.count.value += 1
        return i


def test_the_dataset_reaches_the_workers_as_with_torch_never_copied_here():
    # fork only: under spawn the runtime pickles a segment itself, where such objects refuse
    # (the page says so)
    dataset = SharedCounter()
    loader = DataLoader(dataset, batch_size=2, num_workers=2, multiprocessing_context="fork")
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]
    assert dataset.count.value == 6  # the workers counted in the very object of this process
    assert DataLoader[int] is not None  # generic, as torch's class


def test_an_iterable_dataset_longer_than_its_len_warns_as_torch():
    class Claims4(torch.utils.data.IterableDataset):
        def __len__(self):
            return 4

        def __iter__(self):
            return iter(range(6))

    loader = DataLoader(Claims4(), batch_size=None, num_workers=1)
    assert len(loader) == 4
    with pytest.warns(UserWarning, match=r"but 5 samples have been fetched\. For multiprocessing data-loading"):
        assert [int(x) for x in loader] == list(range(6))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("cls", [TorchDataLoader, DataLoader], ids=["torch", "mprs_plus"])
def test_an_iterable_dataset_longer_than_its_len_is_quiet_when_len_was_not_asked(cls, workers):
    class Claims4(torch.utils.data.IterableDataset):
        def __len__(self):
            return 4

        def __iter__(self):
            return iter(range(6))

    loader = cls(Claims4(), batch_size=None, num_workers=workers)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        assert sorted(int(x) for x in loader) == sorted(list(range(6)) * max(workers, 1))


class Claims5(torch.utils.data.IterableDataset):
    """Says 5 samples and yields up to 16 in each replica; sample 12 fails (with workers, a
    batch of its own that the loop gets as an exception; without, the end of the epoch).
    torch compares its count of batches returned with len(dataset)."""

    def __len__(self):
        return 5

    def __iter__(self):
        for i in range(16):
            if i == 12:
                raise ValueError("sample 12")
            yield i


def length_warnings(cls, **options):
    """Per ``next()``: the batch or the error's type, and the length warnings it gave."""
    loader = cls(Claims5(), **options)
    len(loader)  # what torch's warning compares with, read when the iterator is made
    batches, seen = iter(loader), []
    while True:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                outcome = plain(next(batches))
            except StopIteration:
                break
            except ValueError as error:
                outcome = type(error).__name__
        said = [str(w.message).replace(repr(loader.dataset), "DATASET") for w in caught if "Length of" in str(w.message)]
        seen.append((outcome, said))
    return seen


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("batching", [{"batch_size": None}, {"batch_size": 2}, {"batch_size": 2, "drop_last": True}])
def test_an_iterable_dataset_longer_than_its_len_warns_at_torchs_batch(workers, batching):
    ours = length_warnings(DataLoader, num_workers=workers, **batching)
    assert ours == length_warnings(TorchDataLoader, num_workers=workers, **batching)
    assert any(said for _, said in ours)


def test_an_iterator_keeps_its_workers_after_its_loader_is_gone():
    """As torch's: ``iter(DataLoader(...))`` alone, persistent workers or not."""
    for persistent in (False, True):
        batches = iter(DataLoader(Randomized(8), batch_size=2, num_workers=2, persistent_workers=persistent))
        import gc

        gc.collect()
        assert [b["index"].tolist() for b in batches] == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("cls", [TorchDataLoader, DataLoader])
@pytest.mark.parametrize("persistent", [False, True])
def test_the_iterators_workers_are_its_processes_as_torchs(cls, persistent):
    """``_workers``: what code written for torch's loader reads to watch its workers."""
    loader = cls(Randomized(8), batch_size=2, num_workers=2, persistent_workers=persistent)
    batches = iter(loader)
    next(batches)
    workers = batches._workers
    assert len(workers) == 2
    for worker in workers:
        assert worker.is_alive() and worker.exitcode is None
        assert psutil.Process(worker.pid).ppid() == os.getpid()
    rest = list(batches)
    assert len(rest) == 3
    if persistent:  # the loader keeps them for its next epoch
        assert all(worker.is_alive() for worker in workers)
        epoch = iter(loader)
        assert [w.pid for w in epoch._workers] == [w.pid for w in workers]
        del epoch, batches, loader
        import gc

        gc.collect()
    for worker in workers:  # the epoch (or the loader) ended them: each exits, and says so
        worker.join(30)
        assert not worker.is_alive()
        assert worker.exitcode is not None


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(
    "make_sampler",
    [
        lambda g: SequentialSampler(range(103)),
        lambda g: SequentialSampler(range(100)),  # no short last batch
        lambda g: torch.utils.data.RandomSampler(range(103), generator=g),
        lambda g: torch.utils.data.RandomSampler(range(103), replacement=True, num_samples=77, generator=g),
        lambda g: torch.utils.data.RandomSampler(range(103)),  # seeded from torch's global generator
        lambda g: torch.utils.data.RandomSampler(range(103), num_samples=250, generator=g),  # passes and a rest
        lambda g: torch.utils.data.RandomSampler(range(103), num_samples=206),  # two passes, an empty rest
        lambda g: torch.utils.data.RandomSampler(range(103), num_samples=41, generator=g),
    ],
)
@pytest.mark.parametrize("workers", [1, 3, 4])
def test_an_epoch_drawn_in_one_go_is_torchs_batch_sampler_step_by_step(make_sampler, drop_last, workers):
    import pickle

    from mprs_plus.dataloader.epochs import deal, deal_epoch

    def draw(fast):
        torch.manual_seed(5)
        g = gen()
        batch_sampler = BatchSampler(make_sampler(g), 10, drop_last)
        indices = iter(batch_sampler)
        shares = deal_epoch(batch_sampler, indices, workers) if fast else deal(list(indices), workers)
        return shares, g.get_state().tolist(), torch.rand(1).item()

    (shares, *draws), (expected, *expected_draws) = draw(fast=True), draw(fast=False)
    assert draws == expected_draws  # the same generators' draws
    for share, batches in zip(shares, expected, strict=True):
        share = pickle.loads(pickle.dumps(share))  # as the worker gets it
        assert len(share) == len(batches)
        assert list(share) == batches
        assert all(type(i) is int for batch in share for i in batch)
        assert [share[k] for k in range(-len(share), len(share))] == batches + batches
        for start, stop in [(0, 0), (1, 3), (2, None), (5, 2), (-2, None), (0, 99)]:
            assert list(share[start:stop]) == batches[start:stop]
            assert len(share[start:stop]) == len(batches[start:stop])
        with pytest.raises(IndexError):
            share[len(share)]


def test_a_share_of_indices_is_packed_in_32_bits_where_they_fit():
    """A worker's share travels in its first message: 4 bytes an index where every index
    fits, 8 where one does not; either reads as the same Python ints, and gathers alike."""
    import pickle

    import numpy as np

    from mprs_plus.dataloader.epochs import IndexBatches, _packed, gather

    narrow = IndexBatches(_packed(np.array([5, 0, 2**31 - 1, 7, 3])), 2)
    wide = IndexBatches(_packed(np.array([5, 0, 2**31, 7, -(2**31) - 1])), 2)
    assert narrow._flat.itemsize == 4 and wide._flat.itemsize == 8
    assert list(narrow) == [[5, 0], [2**31 - 1, 7], [3]]
    assert list(pickle.loads(pickle.dumps(wide))) == [[5, 0], [2**31, 7], [-(2**31) - 1]]
    assert all(type(i) is int for batch in narrow for i in batch)
    assert list(gather(narrow, [0, 2])) == [[5, 0], [3]] and list(gather(wide, [1])) == [[2**31, 7]]
    assert len(pickle.dumps(IndexBatches(_packed(np.arange(10_000)), 8))) < 4 * 10_000 + 200


def test_a_random_sampler_that_draws_otherwise_is_read_through_its_iterator(monkeypatch):
    """A shuffled epoch is drawn as ``RandomSampler.__iter__`` draws, without iterating it,
    only where that is checked to give its draws: a patched sampler (or a torch release
    that draws otherwise) is read through its iterator, and the batches are still its."""
    from mprs_plus.dataloader import epochs

    def reversed_draws(self):
        yield from reversed(range(len(self.data_source)))

    batch_sampler = BatchSampler(torch.utils.data.RandomSampler(range(23)), 5, False)
    assert epochs._permutes_as_torch()  # this torch's own sampler: drawn in one go
    monkeypatch.setattr(torch.utils.data.RandomSampler, "__iter__", reversed_draws)
    assert not epochs._permutes_as_torch()
    shares = epochs.deal_epoch(batch_sampler, iter(batch_sampler), 2)
    assert [list(share) for share in shares] == [
        [[22, 21, 20, 19, 18], [12, 11, 10, 9, 8], [2, 1, 0]],
        [[17, 16, 15, 14, 13], [7, 6, 5, 4, 3]],
    ]


def test_the_check_of_the_shuffle_replica_leaves_every_generator_as_it_was(monkeypatch):
    """The one-time check draws from torch's CPU generator and sets it back; it never
    seeds through ``torch.manual_seed``, which would reseed a GPU's generators too."""
    from mprs_plus.dataloader import epochs

    def refuse(*args, **kwargs):
        raise AssertionError("the check seeded through torch.manual_seed")

    monkeypatch.setattr(torch, "manual_seed", refuse)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", refuse)
    monkeypatch.setattr(epochs, "_checked_iter", [None, False])  # not checked yet in this process
    torch.default_generator.manual_seed(5)
    before = torch.get_rng_state()
    assert epochs._permutes_as_torch()
    assert torch.equal(torch.get_rng_state(), before)


def test_a_shuffled_epoch_is_drawn_without_reading_its_iterator(monkeypatch):
    """600,000 shuffled indices read an int at a time cost 60-75 ms before the first batch:
    torch's own ``RandomSampler`` is drawn by its permutations, its iterator never read."""
    from mprs_plus.dataloader import epochs

    assert epochs._permutes_as_torch()
    monkeypatch.setattr(torch.utils.data.RandomSampler, "__iter__", lambda self: pytest.fail("the iterator was read"))
    monkeypatch.setattr(epochs, "_permutes_as_torch", lambda: True)
    batch_sampler = BatchSampler(torch.utils.data.RandomSampler(range(50)), 8, True)
    shares = epochs.deal_epoch(batch_sampler, iter(batch_sampler), 2)
    drawn = [i for share in shares for batch in share for i in batch]
    assert len(drawn) == len(set(drawn)) == 48  # 6 batches of 8 distinct indices, the short last one dropped
    assert set(drawn) <= set(range(50))


@pytest.mark.parametrize(
    "generator, num_samples, permutations",
    [(None, None, 1), (None, 100, 2), (None, 70, 2), ("user's", None, 2), ("user's", 100, 3)],
)
def test_the_empty_last_permutation_is_drawn_only_where_someone_can_see_it(monkeypatch, generator, num_samples, permutations):
    """Forced: permutations are counted. ``RandomSampler``'s iterator ends by drawing one
    more permutation, cut to the rest of ``num_samples``; with nothing to cut and a generator
    of the sampler's own (made from torch's global one, dropped after) nobody sees it, and it
    is not drawn. Where it gives indices, or moves the user's generator, it is, and the
    epoch and every generator are torch's either way."""
    from mprs_plus.dataloader import epochs

    counted = []
    randperm = torch.randperm

    def counting(*args, **kwargs):
        counted.append(args[0])
        return randperm(*args, **kwargs)

    def draw(fast):
        torch.manual_seed(3)
        g = torch.Generator().manual_seed(9) if generator else None
        sampler = torch.utils.data.RandomSampler(range(50), num_samples=num_samples, generator=g)
        batch_sampler = BatchSampler(sampler, 10, False)
        if fast:
            monkeypatch.setattr(torch, "randperm", counting)
            try:
                drawn = [i for share in epochs.deal_epoch(batch_sampler, iter(batch_sampler), 1) for b in share for i in b]
            finally:
                monkeypatch.setattr(torch, "randperm", randperm)
        else:
            drawn = [i for b in batch_sampler for i in b]
        return drawn, (g.get_state().tolist() if g is not None else None), torch.rand(1).item()

    assert epochs._permutes_as_torch()
    assert draw(fast=True) == draw(fast=False)
    assert len(counted) == permutations, counted


def test_a_sequential_epoch_of_millions_is_dealt_without_drawing_its_indices():
    """Without shuffling the indices are known: each worker's share is computed, not drawn
    and held (no time before the first batch, no memory a forked worker maps and unmaps)."""
    import pickle

    from mprs_plus.dataloader.epochs import deal_epoch

    size, count = 64, 5_000_003
    batch_sampler = BatchSampler(SequentialSampler(range(count)), size, False)
    shares = deal_epoch(batch_sampler, iter(batch_sampler), 3)
    assert [len(share) for share in shares] == [26042, 26042, 26042]  # 78,126 batches, the last one short
    for w, share in enumerate(shares):
        assert len(pickle.dumps(share)) < 200
        assert share[0] == list(range(w * size, (w + 1) * size))
    assert shares[2][-1] == list(range(78125 * size, count))  # batch 78,125 is worker 2's (78,125 % 3)
    assert shares[1][-1] == list(range(78124 * size, 78125 * size))


class _SamplerThatBreaks(torch.utils.data.Sampler):
    def __len__(self) -> int:
        return 10

    def __iter__(self):
        raise ValueError("the sampler broke")
        yield


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_sampler_that_raises_as_the_epoch_is_drawn_leaves_nothing_running(context):
    """The epoch is drawn once the run is open (spawned workers already boot): the error
    is the sampler's, and the run it opened stops with it (the autouse check: no shared
    memory left either)."""
    loader = DataLoader(
        list(range(10)), sampler=_SamplerThatBreaks(), batch_size=2, num_workers=2, multiprocessing_context=context
    )
    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(ValueError, match="the sampler broke") as caught:
        iter(loader)
    # Stopped at once, not when the traceback (which holds the iterator) is dropped.
    started = [p for p in psutil.Process().children() if p.pid not in before]
    assert [p for p in started if "resource_tracker" not in " ".join(p.cmdline())] == []  # spawn's own helper stays
    del caught
    batches = list(DataLoader(list(range(10)), batch_size=2, num_workers=2, multiprocessing_context=context))
    assert [batch.tolist() for batch in batches] == [[i, i + 1] for i in range(0, 10, 2)]  # and the next loader runs


def _private_dirty_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Private_Dirty in smaps_rollup")


class _ObjectsDataset(Dataset):
    """A dataset of a million small Python objects (~100 MB of heap in the parent); its
    one sample is what a garbage collection in the worker copied of the parent's pages."""

    def __init__(self) -> None:
        self.rows = [[i] for i in range(1_000_000)]

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> int:
        import gc

        before = _private_dirty_bytes()
        gc.collect()
        return _private_dirty_bytes() - before


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="reads Linux's /proc/self/smaps_rollup")
def test_a_garbage_collection_in_a_forked_worker_does_not_copy_the_datasets_objects():
    """A worker holds the parent's Python objects once: a collection in the worker does not
    visit what the worker inherited (it would write to every object's header, and the
    kernel would copy each page they lie on: ~100 MB here, per worker)."""
    dataset = _ObjectsDataset()
    [copied] = list(DataLoader(dataset, batch_size=None, num_workers=1, multiprocessing_context="fork"))
    assert copied < 10 << 20, f"a collection in the worker copied {copied >> 20} MiB of the parent's heap"
