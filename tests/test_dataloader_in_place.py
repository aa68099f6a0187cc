"""``default_collate`` in a worker of ``mprs_plus.DataLoader`` stacks a large batch straight
into the memory that crosses to the main process (its output channel's lend area), and the
channel publishes it without copying it: torch's batches, value for value, with no copy in
the worker. Anything unusual, or too small, takes torch's own path unchanged."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, default_collate

from mprs_plus import DataLoader
from mprs_plus.dataloader import stage
from mprs_plus.runtime.child import lanes
from mprs_plus.transport import streaming

pytestmark = pytest.mark.timeout(120)

SAMPLE = 64 << 10  # float32 elements: 256 KiB a sample


class Rows(Dataset):
    """Sample i: 256 KiB of float32, its index then a ramp (every batch of 4 is 1 MiB)."""

    def __init__(self, n: int = 24) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        row = torch.arange(SAMPLE, dtype=torch.float32)
        row[0] = i
        return row


class Small(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.full((16,), i), "y": i}


def worker_figures(loader) -> tuple[int, int]:
    workers = [p for p in loader.stats().processes if p.role == "worker"]
    return sum(p.large_built_in_place for p in workers), sum(p.large_copied_in for p in workers)


def test_large_batches_are_torchs_and_the_workers_copy_none_of_them():
    ours = DataLoader(Rows(), batch_size=4, num_workers=2)
    theirs = torch.utils.data.DataLoader(Rows(), batch_size=4)
    count = 0
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine.dtype == reference.dtype and mine.shape == reference.shape == (4, SAMPLE)
        assert torch.equal(mine, reference)
        count += 1
        del mine  # its extent goes back before the next batch
    built, copied = worker_figures(ours)
    assert count == 6 and built == 6 and copied == 0
    assert "6 built straight into shared memory (no copy), 0 copied into it" in ours.stats().summary()


def test_small_batches_take_torchs_path():
    loader = DataLoader(Small(), batch_size=3, num_workers=2)
    batches = list(loader)
    reference = list(torch.utils.data.DataLoader(Small(), batch_size=3))
    assert len(batches) == len(reference) == 4
    for mine, theirs in zip(batches, reference):
        assert torch.equal(mine["x"], theirs["x"]) and torch.equal(mine["y"], theirs["y"])
    assert worker_figures(loader) == (0, 0)


class Failed(Exception):
    pass


def collate_then_fail(batch):
    """default_collate builds the batch (in place), then the user's code raises for two
    batches of every three: the built batch is dropped unsent."""
    stacked = default_collate(batch)
    if int(stacked[0, 0]) % 12 != 0:
        raise Failed(f"batch starting at sample {int(stacked[0, 0])} rejected after collating")
    return stacked


def test_a_collate_that_raises_after_building_gives_the_memory_back(monkeypatch):
    """Each worker drops 20 MiB of batches built in its channel's 16 MiB lend area: were an
    extent of a dropped batch kept, the batches after it could not be built in place."""
    from mprs_plus.runtime.main import service

    monkeypatch.setattr(service, "_DATA_BYTES", 4 << 20)  # a 4 MiB ring: a 16 MiB lend area
    loader = DataLoader(Rows(120), batch_size=8, num_workers=2, collate_fn=collate_then_fail)  # 2 MiB batches
    iterator = iter(loader)
    kept, failed = [], 0
    for _ in range(15):
        try:
            batch = next(iterator)
        except Failed as exc:
            assert "Caught Failed in DataLoader worker process" in str(exc) and "rejected after collating" in str(exc)
            failed += 1
        else:
            kept.append(int(batch[0, 0]))
            del batch
    with pytest.raises(StopIteration):
        next(iterator)
    assert failed == 10 and kept == [0, 24, 48, 72, 96]
    built, copied = worker_figures(loader)
    assert built == 5 and copied == 0


# -- which batches are built in place (no processes: a fake lane lends ordinary memory) ---


class Lent(list):
    """The buffers a fake lane lent, held weakly: a buffer alive is one that a tensor still
    holds (the real lane takes an extent back when its tensor dies)."""

    def alive(self) -> list[np.ndarray]:
        gc.collect()
        return [buffer for buffer in (ref() for ref in self) if buffer is not None]


@pytest.fixture(params=["stacked", "streamed"])
def lent(monkeypatch, request):
    """The calling thread's lane, faked: it lends numpy buffers and remembers them. Each
    test runs twice: a batch built in place is stacked by torch into the buffer, or
    written into it with streaming stores (forced for every size, and counted in
    ``streamed``); whichever way, the same tensor."""
    buffers = Lent()
    buffers.streamed = 0

    def borrow(nbytes: int) -> np.ndarray:
        buffer = np.empty(nbytes, dtype=np.uint8)
        buffers.append(weakref.ref(buffer))
        return buffer

    monkeypatch.setattr(lanes, "borrow_for_current_lane", borrow)
    if request.param == "streamed":
        if not streaming.ENABLED:
            pytest.skip("the streaming-store extension is not built here (tests/transport/test_transport_streaming.py)")
        copy = streaming.copy_from_address

        def counted(*args):
            buffers.streamed += 1
            return copy(*args)

        monkeypatch.setattr(streaming, "MIN_BYTES", 0)
        monkeypatch.setattr(streaming, "copy_from_address", counted)
    else:
        monkeypatch.setattr(streaming, "ENABLED", False)
    buffers.mode = request.param
    return buffers


def built_in(tensor: torch.Tensor, buffers: Lent) -> bool:
    return any(tensor.data_ptr() == b.__array_interface__["data"][0] for b in buffers.alive())


def collate(batch):
    return stage._collate_tensors(batch)


def test_a_plain_large_batch_is_stacked_into_the_lent_buffer(lent):
    batch = [torch.randn(256, 128) for _ in range(4)]  # 512 KiB
    out = collate(batch)
    assert built_in(out, lent) and len(lent) == 1
    assert out.is_contiguous() and out.dtype == torch.float32 and out.shape == (4, 256, 128)
    assert torch.equal(out, torch.stack(batch))
    assert lent.streamed == (4 if lent.mode == "streamed" else 0)


@pytest.mark.parametrize("extra", [0, 1, 15, 63, 65])
def test_views_at_any_offset_and_odd_sizes_are_built_value_for_value(lent, extra):
    """Elements that start anywhere in their storage, of sizes that leave every element of
    the batch at another alignment: each byte lands where torch.stack puts it."""
    size = (16 << 10) + extra
    storage = torch.randint(0, 256, (9 * size + 7,), dtype=torch.uint8)
    batch = [storage[3 + k * size : 3 + (k + 1) * size] for k in range(9)]  # 144 KiB and more
    out = collate(batch)
    assert built_in(out, lent) and torch.equal(out, torch.stack(batch))
    assert lent.streamed == (9 if lent.mode == "streamed" else 0)


def test_a_batch_of_elements_of_16_kib_is_stacked_into_the_lent_buffer(lent):
    batch = [torch.randn(4096) for _ in range(32)]  # 16 KiB each, 512 KiB
    out = collate(batch)
    assert built_in(out, lent) and torch.equal(out, torch.stack(batch))


@pytest.mark.parametrize(
    "make",
    [
        lambda: [torch.ones(16) for _ in range(4)],  # too small
        lambda: [torch.ones(256) for _ in range(512)],  # 512 KiB in rows of 1 KiB: copying costs less
        lambda: [torch.ones(256, 128), torch.ones(256, 128, dtype=torch.float64)],  # mixed dtypes
        lambda: [torch.ones(256, 128).t() for _ in range(4)],  # not contiguous
        lambda: [torch.ones(256, 128, requires_grad=True) for _ in range(4)],
        lambda: [torch.ones(256, 128), torch.ones(128, 256)],  # torch's error
        lambda: [torch.ones(256, 128), np.ones((256, 128), dtype=np.float32)],  # not all tensors
        lambda: [torch.nn.Parameter(torch.ones(256, 128), requires_grad=False) for _ in range(2)],  # a subclass
        # The first element plain, a later one not: torch's stack finds most of these.
        lambda: [torch.ones(256, 128), torch.ones(256, 128).t().contiguous().t()],
        lambda: [torch.ones(256, 128), torch.ones(256, 128, requires_grad=True)],
        lambda: [torch.ones(256, 128), torch.ones(256, 128).to_sparse()],
        lambda: [torch.ones(256, 128), torch.ones(256, 128, device="meta")],
        lambda: [torch.ones(256, 128), torch.nn.Parameter(torch.ones(256, 128), requires_grad=False)],
        lambda: [torch.ones(256, 128), torch.quantize_per_tensor(torch.ones(256, 128), 0.1, 0, torch.qint8)],
    ],
    ids=[
        "small",
        "many small rows",
        "mixed dtypes",
        "non-contiguous",
        "requires_grad",
        "later of another shape",
        "not all tensors",
        "subclass",
        "later non-contiguous",
        "later requires_grad",
        "later sparse",
        "later on another device",
        "later a subclass",
        "later quantized",
    ],
)
def test_anything_unusual_takes_torchs_own_path(lent, make, request):
    batch = make()
    try:
        expected = torch.utils.data._utils.collate.collate_tensor_fn(batch)
    except Exception as exc:  # torch's own error: ours must be the same
        with pytest.raises(type(exc)):
            collate(batch)
    else:
        out = collate(batch)
        assert type(out) is type(expected) and out.dtype == expected.dtype and torch.equal(out, expected)
        assert out.stride() == expected.stride()
        del out
    if not any(part.startswith("later") for part in request.node.callspec.id.split("-")):
        assert lent == []  # the first element decided it: nothing was borrowed
    # A later element may have been found unusual by the stack into a borrowed extent:
    # the extent went back, as the real lane's does when its tensor dies.
    assert lent.alive() == []


def test_a_later_nested_tensor_takes_torchs_own_path(lent):
    batch = [torch.ones(256, 128), torch.nested.nested_tensor([torch.ones(256, 128)])]
    with pytest.raises(RuntimeError):  # torch's own error: a nested tensor has no shape to stack
        torch.utils.data._utils.collate.collate_tensor_fn(batch)
    with pytest.raises(RuntimeError):
        collate(batch)
    assert lent.alive() == []


@pytest.mark.parametrize(
    "view",
    [lambda t: torch._neg_view(t), lambda t: t.to(torch.complex64).conj()],
    ids=["negative bit", "conjugate bit"],
)
def test_a_later_view_with_a_pending_bit_is_built_in_place_value_for_value(lent, view):
    plain = torch.randn(256, 128)
    later = view(torch.randn(256, 128))
    batch = [plain.to(later.dtype), later]
    out = collate(batch)
    expected = torch.utils.data._utils.collate.collate_tensor_fn(batch)
    assert built_in(out, lent)
    assert out.dtype == expected.dtype and torch.equal(out, expected) and not out.is_conj() and not out.is_neg()


def test_no_room_takes_torchs_own_path(monkeypatch):
    monkeypatch.setattr(lanes, "borrow_for_current_lane", lambda nbytes: None)
    batch = [torch.randn(256, 128) for _ in range(4)]
    assert torch.equal(collate(batch), torch.stack(batch))


def test_outside_a_lane_nothing_is_borrowed():
    """The thread that runs no lane (the main process, or a user's thread in a worker)."""
    assert lanes.borrow_for_current_lane(1 << 20) is None
    batch = [torch.randn(256, 128) for _ in range(4)]
    assert torch.equal(collate(batch), torch.stack(batch))


# -- batches of plain numbers: made through numpy in a worker, torch's tensors all the same --


@pytest.mark.parametrize(
    "batch",
    [
        list(range(64)),
        [3, True, False, -(2**63), 2**63 - 1],  # bools after an int, int64's ends
        [1, 2**63],  # outside int64: torch's own error
        [True, False],  # a first bool: torch makes a bool tensor
        [1, 2.5],  # a float among ints: torch's function decides
        [0.5, float("nan"), float("inf"), -0.0],
        [0.5, 1],  # an int among floats
        [np.float64(0.5), 1.5],  # a float subclass first
    ],
    ids=["ints", "bools after an int", "too large", "bools", "int then float", "floats", "float then int", "numpy float"],
)
def test_numbers_collate_in_a_worker_as_torch_collates_them(batch):
    """Against the function of torch's that ``default_collate`` picks for the first element
    (a bool is an int there), which ours replaces in a worker."""
    from torch.utils.data._utils import collate as torch_collate

    if isinstance(batch[0], int):
        torchs, ours = torch_collate.collate_int_fn, stage._collate_ints
    else:
        torchs, ours = torch_collate.collate_float_fn, stage._collate_floats
    try:
        expected = torchs(batch)
    except Exception as exc:  # torch's own error: ours must be the same
        with pytest.raises(type(exc)):
            ours(batch)
        return
    out = ours(batch)
    assert type(out) is torch.Tensor and out.dtype == expected.dtype and out.shape == expected.shape
    assert torch.equal(out.isnan(), expected.isnan()) if out.is_floating_point() else True
    assert torch.equal(torch.nan_to_num(out), torch.nan_to_num(expected))
    assert torch.equal(out.signbit(), expected.signbit())  # -0.0 stays -0.0
    assert out.untyped_storage().resizable()  # a storage of torch's own, as torch.tensor makes


def test_a_worker_collates_numbers_with_our_functions_only_where_torchs_are_in_the_map(monkeypatch):
    from torch.utils.data._utils import collate as torch_collate

    mine = lambda batch, *, collate_fn_map=None: "mine"  # noqa: E731
    monkeypatch.setitem(torch_collate.default_collate_fn_map, int, mine)
    monkeypatch.setitem(torch_collate.default_collate_fn_map, float, torch_collate.collate_float_fn)
    stage.collate_tensors_privately()
    assert torch_collate.default_collate_fn_map[int] is mine  # a user's function stays
    assert torch_collate.default_collate_fn_map[float] is stage._collate_floats
