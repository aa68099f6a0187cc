"""Datasets and helpers shared by the tests of mprs_plus.DataLoader (importable by spawned
workers, which unpickle them by reference)."""

import collections
import random

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

Pair = collections.namedtuple("Pair", "left right")


class Randomized(Dataset):
    """Each sample draws from random, torch and numpy, and says which worker made it."""

    def __init__(self, n=23):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = get_worker_info()
        return {
            "index": i,
            "random": random.random(),
            "torch": torch.rand(2),
            "numpy": np.random.rand(2),
            "worker": -1 if info is None else info.id,
            "seed": -1 if info is None else info.seed,
        }


class Nested(Dataset):
    def __len__(self):
        return 9

    def __getitem__(self, i):
        return Pair({"a": torch.full((2, 2), i), "b": (np.arange(3) * i, f"s{i}")}, [i, float(i) / 2, torch.tensor(i)])


class Ranges(IterableDataset):
    """Worker w yields its own number of samples, so workers end at different batches."""

    def __iter__(self):
        info = get_worker_info()
        worker = 0 if info is None else info.id
        for k in range(9 - 4 * worker):
            yield {"worker": worker, "k": k, "draw": torch.rand(1)}


def plain(value):
    """Nested batches as plain Python values, to compare exactly."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.tolist())
    if isinstance(value, np.ndarray):
        return ("array", value.tolist())
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return (type(value).__name__, *[plain(v) for v in value])
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def run(cls, make, epochs=2):
    """Batches of ``epochs`` epochs of ``make(cls)``, every generator seeded first; and the
    main process's generators after them (torch's draws advance them)."""
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    loader = make(cls)
    out = [[plain(batch) for batch in loader] for _ in range(epochs)]
    return out, torch.rand(1).item()


def gen(seed=3):
    return torch.Generator().manual_seed(seed)


def add_one(worker_id):
    random.seed(1000 + worker_id)  # worker_init_fn runs after torch's seeding


def sum_collate(samples):
    return sum(sample["index"] for sample in samples), len(samples)


class Endless(torch.utils.data.Sampler):
    """An infinite sampler without len(): random indices drawn from torch's global generator."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        while True:
            yield int(torch.randint(self.n, ()).item())


class Unsized(torch.utils.data.Sampler):
    """A finite sampler without len(), shuffling with its own generator."""

    def __init__(self, n, seed):
        self.n = n
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=self.generator).tolist())


def noisy(x):
    return {"x": x, "draw": torch.rand(1)}


def datapipe(n=20):
    """A DataPipe dataset, as torch's DataLoader takes one: shuffled, sharded, a random map."""
    from torch.utils.data.datapipes.iter import IterableWrapper

    return IterableWrapper(range(n)).shuffle().sharding_filter().map(noisy)


class Ragged(torch.utils.data.Dataset):
    """Each sample a nested tensor of rows of different lengths; every third one over
    128 KiB, the size from which tensors travel through shared memory."""

    def __len__(self):
        return 7

    def __getitem__(self, i):
        size = 40_000 if i % 3 == 0 else 3
        return torch.nested.nested_tensor([torch.full((size + k,), float(i)) for k in range(i % 3 + 1)])


def nest(samples):
    """A collate function that keeps nested tensors: one nested tensor of every sample's rows."""
    return torch.nested.nested_tensor([row for sample in samples for row in sample.unbind()])


def rows(batch):
    """A nested tensor as its rows' values, to compare exactly."""
    assert batch.is_nested
    return [row.tolist() for row in batch.unbind()]
