"""A process forked while its parent holds lent tensors keeps exactly the bytes it
inherited, however long it keeps them, and its writes never reach the parent: the
copy-on-write semantics of any tensor, although these are views of shared memory.

Each test holds two lent items A and B from a loader, forks (``os.fork``, a
multiprocessing fork child, the workers of a torch DataLoader), then the child writes
into B and the parent checks its own B; the parent drops A, reads 1,000 more items
(their extents are refilled many times over) and only then lets the child look at A."""

from __future__ import annotations

import functools
import multiprocessing
import os

import pytest
import torch
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

import pipelines
from mprs_plus import MultiProcessingReadingService
from mprs_plus.transport import _lend, lending

FORK = multiprocessing.get_context("fork")
NUMEL = 256 << 10  # float32: 1 MiB, lent
MOVE_ON = 1000
SCRIBBLE = -7.0


def tensor_loader() -> DataLoader2:
    pipe = IterableWrapper(range(10 * MOVE_ON)).sharding_filter()
    pipe = pipe.map(functools.partial(pipelines.filled_tensor, numel=NUMEL))
    return DataLoader2(pipe, reading_service=MultiProcessingReadingService(2))


def uniform(tensor: torch.Tensor) -> float | None:
    """The one value every element holds, or None. Through numpy: a child forked after
    torch ran a parallel operation hangs in its next one (OpenMP's thread pool)."""
    array = tensor.numpy()
    low, high = float(array.min()), float(array.max())
    return low if low == high else None


def hold_two(loader_iter) -> tuple[torch.Tensor, torch.Tensor]:
    before = lending().lent
    a, b = next(loader_iter), next(loader_iter)
    assert (uniform(a), uniform(b)) == (0.0, 1.0)
    assert lending().lent - before == 2, "the items were not lent: this test would test nothing"
    return a, b


def move_on(loader_iter, count: int = MOVE_ON) -> None:
    for _ in range(count):
        item = next(loader_iter)
        assert uniform(item) is not None
    del item


def child_side(a: torch.Tensor, b: torch.Tensor, written, go) -> int:
    """In the child: scribble over B, say so, wait until the parent moved on, look at A.
    The exit code says what was wrong: 0 nothing, 3 A changed, 4 B changed under us."""
    b.numpy().fill(SCRIBBLE)
    written()
    go()
    if uniform(a) != 0.0:
        return 3
    if uniform(b) != SCRIBBLE:
        return 4
    return 0


@pytest.fixture(params=["mremap", "without mremap"])
def remap(request, monkeypatch):
    """The child's private copy made by Linux's ``mremap``, or, as where there is none
    (macOS), by copying aside and mapping over the extent."""
    if request.param == "without mremap":
        libc, memmove, _mremap = _lend._libc()
        monkeypatch.setattr(_lend, "_LIBC", (libc, memmove, None))
    return request.param


@pytest.mark.timeout(120)
def test_os_fork_child_keeps_its_bytes_and_its_writes(remap):
    loader = tensor_loader()
    try:
        items = iter(loader)
        a, b = hold_two(items)
        written_r, written_w = os.pipe()
        go_r, go_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                os.close(written_r)
                os.close(go_w)
                code = child_side(a, b, lambda: os.close(written_w), lambda: os.read(go_r, 1))
            finally:
                os._exit(code)
        os.close(written_w)
        os.close(go_r)
        try:
            assert os.read(written_r, 1) == b""  # the child wrote B and closed its end
            assert uniform(b) == 1.0, "the child's write reached the parent"
            del a, b
            move_on(items)
        finally:
            os.close(go_w)  # go
            os.close(written_r)
            _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "3: the child's A changed under it"
    finally:
        loader.shutdown()


def _mp_child(a, b, written, go) -> None:
    os._exit(child_side(a, b, written.set, lambda: go.wait(60)))


@pytest.mark.timeout(120)
def test_multiprocessing_fork_child_keeps_its_bytes_and_its_writes():
    loader = tensor_loader()
    try:
        items = iter(loader)
        a, b = hold_two(items)
        written, go = FORK.Event(), FORK.Event()
        child = FORK.Process(target=_mp_child, args=(a, b, written, go))
        child.start()
        try:
            assert written.wait(60)
            assert uniform(b) == 1.0, "the child's write reached the parent"
            del a, b
            move_on(items)
        finally:
            go.set()
            child.join(60)
        assert child.exitcode == 0, "3: the child's A changed under it"
    finally:
        loader.shutdown()


class HeldItems(torch.utils.data.Dataset):
    """Item i of a torch DataLoader worker: what its inherited copy of ``held[i]`` holds
    once the parent moved on, after writing into it."""

    def __init__(self, held: list[torch.Tensor], go) -> None:
        self.held = held
        self.go = go

    def __len__(self) -> int:
        return len(self.held)

    def __getitem__(self, index: int) -> tuple[float | None, float | None]:
        item = self.held[index]
        if index == 1:
            item.numpy().fill(SCRIBBLE)
        assert self.go.wait(60)
        return uniform(item), float(index)


@pytest.mark.timeout(120)
def test_torch_dataloader_workers_forked_while_items_are_held():
    loader = tensor_loader()
    try:
        items = iter(loader)
        a, b = hold_two(items)
        go = FORK.Event()
        dataset = HeldItems([a, b], go)
        workers = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="fork")
        results = iter(workers)  # forks both workers: each inherits A and B
        dataset.held.clear()
        del a
        move_on(items)
        go.set()
        seen = sorted((index, value) for value, index in results)
        assert uniform(b) == 1.0, "a worker's write reached the parent"
        assert seen == [(0.0, 0.0), (1.0, SCRIBBLE)], "a worker's A changed under it"
    finally:
        loader.shutdown()
