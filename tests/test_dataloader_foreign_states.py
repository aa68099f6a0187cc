"""Datasets whose ``state_dict()`` is not torchdata's protocol, or raises: the batches are
torch's all the same, and a state of the loader restores them exactly, by replay."""

import warnings

import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from mprs_plus import DataLoader
from mprs_plus.dataloader.stage import has_state
from loader_datasets import plain

pytestmark = pytest.mark.timeout(180)


def _share():
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class Streaming(IterableDataset):
    """Each worker reads its own samples, and each sample draws from the worker's generator."""

    n = 17

    def __iter__(self):
        worker, workers = _share()
        for i in range(worker, self.n, workers):
            yield {"index": i, "draw": torch.rand(1)}


class LitdataShaped(Streaming):
    """litdata's ``StreamingDataset`` (0.2): its state is computed for its own loader."""

    def state_dict(self, num_samples: int, num_workers: int, batch_size: int) -> dict:
        return {"num_samples": num_samples, "num_workers": num_workers, "batch_size": batch_size}

    def load_state_dict(self, state_dict: dict) -> None:
        raise AssertionError("a state of this shape is never taken, so never loaded")


class MosaicShaped(Streaming):
    """Mosaic's ``streaming.StreamingDataset``: the same, with its own arguments."""

    def state_dict(self, num_samples: int, from_beginning: bool) -> dict:
        return {"sample_in_epoch": num_samples}

    def load_state_dict(self, obj: dict) -> None:
        raise AssertionError("a state of this shape is never taken, so never loaded")


def test_a_state_dict_that_needs_arguments_is_not_the_protocol():
    assert not has_state(LitdataShaped()) and not has_state(MosaicShaped())

    class Optional(Streaming):
        def state_dict(self, prefix="", *args, **kwargs):
            return {}

        def load_state_dict(self, state):
            pass

    assert has_state(Optional())


def _restores_every_batch(make, epochs=2):
    """For every k: a state after k batches restores, in a new loader, to the rest of the
    uninterrupted run (the first epoch's and the next one's batches)."""
    torch.manual_seed(5)
    reference = make()
    full = [[plain(b) for b in reference] for _ in range(epochs)]
    for k in range(len(full[0]) + 1):
        torch.manual_seed(5)
        loader = make()
        batches = iter(loader)
        head = [plain(next(batches)) for _ in range(k)]
        state = loader.state_dict()
        del batches, loader
        torch.manual_seed(99)  # the restore, not the global seed, decides what comes
        restored = make()
        restored.load_state_dict(state)
        assert head + [plain(b) for b in restored] == full[0], k
        assert [[plain(b) for b in restored] for _ in range(epochs - 1)] == full[1:], k
    return full


@pytest.mark.parametrize("cls", [LitdataShaped, MosaicShaped])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_streaming_dataset_gives_torchs_batches_and_restores_by_replay(cls, workers):
    full = _restores_every_batch(lambda: DataLoader(cls(), batch_size=3, num_workers=workers))
    torch.manual_seed(5)
    torch_loader = TorchDataLoader(cls(), batch_size=3, num_workers=workers)
    assert [[plain(b) for b in torch_loader] for _ in range(2)] == full


class RaisesFrom(IterableDataset):
    """A state (where the worker is, and its generator) that raises once the dataset has
    read ``fails_from`` samples of its epoch."""

    def __init__(self, fails_from):
        self.fails_from = fails_from
        self.position = 0

    def __iter__(self):
        worker, workers = _share()
        indices = range(worker, 14, workers)
        while self.position < len(indices):
            self.position += 1
            yield {"index": indices[self.position - 1], "draw": torch.rand(1)}
        self.position = 0

    def state_dict(self):
        if self.position >= self.fails_from:
            raise RuntimeError("this state cannot be taken")
        return {"position": self.position, "rng": torch.get_rng_state().tolist()}

    def load_state_dict(self, state):
        self.position = state["position"]
        torch.set_rng_state(torch.tensor(state["rng"], dtype=torch.uint8))


class MapRaisesFrom(Dataset):
    """The same, map-style: its state is the worker's generator, until it raises."""

    def __init__(self, fails_from):
        self.fails_from = fails_from
        self.read = 0

    def __len__(self):
        return 14

    def __getitem__(self, i):
        self.read += 1
        return {"index": i, "draw": torch.rand(1)}

    def state_dict(self):
        if self.read >= self.fails_from:
            raise RuntimeError("this state cannot be taken")
        return {"read": self.read, "rng": torch.get_rng_state().tolist()}

    def load_state_dict(self, state):
        self.read = state["read"]
        torch.set_rng_state(torch.tensor(state["rng"], dtype=torch.uint8))


def _ours(caught):
    return [w for w in caught if "state_dict() raised RuntimeError: this state cannot be taken" in str(w.message)]


@pytest.mark.parametrize("cls", [RaisesFrom, MapRaisesFrom])
@pytest.mark.parametrize("workers, persistent", [(0, False), (2, False), (2, True)])
@pytest.mark.parametrize("fails_from", [0, 4])
def test_a_state_dict_that_raises_warns_once_and_restores_by_replay(cls, workers, persistent, fails_from):
    def make():
        return DataLoader(cls(fails_from), batch_size=2, num_workers=workers, persistent_workers=persistent)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        full = _restores_every_batch(make)
    assert sorted(i for b in full[0] for i in b["index"][2]) == list(range(14))
    ours = _ours(caught)
    assert ours, [str(w.message)[:80] for w in caught]
    assert all(w.filename == __file__ for w in ours), {w.filename for w in ours}

    # Once per loader, however many states are taken.
    loader = make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            for _ in loader:
                loader.state_dict()
            loader.state_dict()
    assert len(_ours(caught)) == 1


class RaisingSampler(torch.utils.data.Sampler):
    """A sampler with a state it cannot give: the epoch goes on with torch's batches."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())

    def state_dict(self):
        raise RuntimeError("this state cannot be taken")

    def load_state_dict(self, state):
        raise AssertionError("never taken, so never loaded")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_whose_state_dict_raises_warns_and_the_batches_go_on(workers):
    torch.manual_seed(5)
    expected = [b.tolist() for b in TorchDataLoader(list(range(10)), batch_size=3, sampler=RaisingSampler(10))]
    torch.manual_seed(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = DataLoader(list(range(10)), batch_size=3, sampler=RaisingSampler(10), num_workers=workers)
        batches = iter(loader)
        head = [next(batches).tolist() for _ in range(2)]
        state = loader.state_dict()
        rest = [b.tolist() for b in batches]
    assert head + rest == expected
    ours = _ours(caught)
    assert ours and all(w.filename == __file__ for w in ours), [str(w.message)[:80] for w in caught]
    restored = DataLoader(list(range(10)), batch_size=3, sampler=RaisingSampler(10), num_workers=workers)
    restored.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert [b.tolist() for b in restored] == rest  # its order drawn again from the recorded generator
