"""A dataset and a hook for the tests of warm Ray actors (importable on the actors): each
sample says what the worker saw (the dataset's shift now, its worker, its draws), and the
hook records each call with the process it ran in."""

import os
import random

import torch
from torch.utils.data import Dataset, get_worker_info


class Shifted(Dataset):
    """Sample i is i + ``shift``, with the worker's id and seed and a draw of each generator."""

    def __init__(self, n=12):
        self.n = n
        self.shift = 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = get_worker_info()
        return torch.tensor([i + self.shift, info.id, info.seed % 1000003, random.random(), float(torch.rand(()))])


class RecordsInit:
    """A worker_init_fn (torch's ``(worker_id)`` or torchdata's ``(datapipe, WorkerInfo)``)
    that appends ``pid worker_id draw`` to ``path``."""

    def __init__(self, path):
        self.path = path

    def __call__(self, *args):
        worker = args[0] if len(args) == 1 else args[1].worker_id
        with open(self.path, "a") as log:
            log.write(f"{os.getpid()} {worker} {random.random()!r}\n")
        return None if len(args) == 1 else args[0]


def calls(path):
    """The recorded calls: [(pid, worker_id, draw)]."""
    if not os.path.exists(path):
        return []
    with open(path) as log:
        return [(int(p), int(w), d) for p, w, d in (line.split() for line in log)]
