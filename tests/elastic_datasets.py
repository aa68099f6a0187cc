"""Datasets for the tests of ``seeding="batch"`` and elastic restores (importable by
spawned workers, which unpickle them by reference)."""

import random

import numpy as np
import torch
from torch.utils.data import Dataset


class Augmented(Dataset):
    """A random augmentation of each sample, drawn from ``random``, numpy's and torch's
    global generators: ``(index, three draws)``."""

    def __init__(self, n=30):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i, random.random(), float(np.random.rand()), float(torch.rand(()))], dtype=torch.float64)


class Indices(Dataset):
    """Each sample its index: which samples a loader makes, not how."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def rows(batch):
    return [tuple(row) for row in batch.tolist()]
