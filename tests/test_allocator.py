"""Every worker this engine starts pins glibc's allocator thresholds, so that no worker maps
and unmaps fresh pages for every large sample (``runtime/child/allocator.py``)."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch
from torch.utils.data import Dataset

from mprs_plus import DataLoader
from mprs_plus.runtime.child import allocator

pytestmark = pytest.mark.timeout(120)

GLIBC = allocator._is_glibc()
PROBE = 24 << 20  # under the pinned mmap threshold, over every default one


class FakeLibc:
    def __init__(self, answer: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.answer = answer

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.answer


@pytest.fixture
def unpinned(monkeypatch):
    monkeypatch.setattr(allocator, "_pinned", False)


def test_both_thresholds_are_pinned_where_glibc_would_end_at_most(unpinned):
    libc = FakeLibc()
    assert allocator.pin_thresholds(libc, environ={})
    assert libc.calls == [(allocator.M_MMAP_THRESHOLD, 32 << 20), (allocator.M_TRIM_THRESHOLD, 64 << 20)]
    assert allocator.pinned()


def test_a_threshold_the_environment_sets_is_left_to_it(unpinned):
    libc = FakeLibc()
    assert allocator.pin_thresholds(libc, environ={"MALLOC_MMAP_THRESHOLD_": "1048576"})
    assert libc.calls == [(allocator.M_TRIM_THRESHOLD, 64 << 20)]


def test_a_refusal_or_a_failing_library_is_reported_not_raised(unpinned):
    assert not allocator.pin_thresholds(FakeLibc(answer=0), environ={})
    assert not allocator.pinned()

    class Broken:
        def mallopt(self, param: int, value: int) -> int:
            raise OSError("no such symbol")

    assert not allocator.pin_thresholds(Broken(), environ={})


def test_nothing_is_done_where_glibc_is_not_the_c_library(unpinned, monkeypatch):
    monkeypatch.setattr(os, "confstr", lambda name: None)  # musl: no glibc version
    assert not allocator.pin_thresholds(environ={})
    assert not allocator.pinned()


def mapped_blocks() -> int:
    """The number of blocks glibc's malloc holds in mappings of their own."""
    libc = ctypes.CDLL(None)
    fields = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd")]
    fields += [(name, ctypes.c_size_t) for name in ("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    class MallInfo2(ctypes.Structure):
        _fields_ = fields

    libc.mallinfo2.restype = MallInfo2
    return libc.mallinfo2().hblks


class Probe(Dataset):
    """In the worker: were the thresholds pinned, and does a 24 MiB malloc come from the
    heap (no new mapped block) rather than from a mapping of its own?"""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> torch.Tensor:
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        before = mapped_blocks()
        block = libc.malloc(PROBE)
        after = mapped_blocks()
        libc.free(block)
        return torch.tensor([allocator.pinned(), after - before, os.getpid()])


@pytest.mark.skipif(not GLIBC or not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="glibc 2.33 or later only")
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_worker_the_engine_starts_serves_large_allocations_from_its_heap(context):
    loader = DataLoader(Probe(), batch_size=1, num_workers=2, multiprocessing_context=context)
    answers = [batch[0].tolist() for batch in loader]
    assert len({pid for _, _, pid in answers}) == 2  # one answer from each worker
    assert all(pinned == 1 and new_mappings == 0 for pinned, new_mappings, _ in answers), answers
