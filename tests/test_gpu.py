"""pin_memory=True and device= on a real CUDA device: pinned where they lie, equal to what
the workers made while the workers reuse extents at full speed, batches dropped at once
under slow kernels never overwritten, a refused registration that disturbs nothing, and
nothing left behind. Skipped without CUDA (the rules themselves are tested without a
device, through fakes: tests/transport/test_transport_page_locking.py,
tests/test_feeding.py and tests/test_gpu_seams.py)."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from mprs_plus import MultiProcessingReadingService

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MIB = 1 << 20


def patterned(index: int, nbytes: int = 4 * MIB) -> torch.Tensor:
    """Item ``index``: bytes that differ from every other item's at almost every position."""
    return (torch.arange(nbytes, dtype=torch.int64) * 7 + index * 13).remainder(251).to(torch.uint8)


def make_pipe(count: int, nbytes: int):
    return IterableWrapper(range(count)).sharding_filter().map(lambda_free_pattern(nbytes))


class lambda_free_pattern:
    """A picklable ``index -> (index, tensor)``: spawn-safe without dill."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __call__(self, index: int) -> tuple[int, torch.Tensor]:
        return index, patterned(index, self.nbytes)


def small_item(index: int) -> dict:
    return {"index": index, "x": torch.full((16,), index, dtype=torch.int32)}


def test_every_tensor_arrives_pinned_and_pin_memory_then_costs_nothing():
    service = MultiProcessingReadingService(2, pin_memory=True)
    loader = DataLoader2(make_pipe(16, 1 * MIB), reading_service=service)
    try:
        for index, tensor in loader:
            assert tensor.is_pinned()
            assert tensor.pin_memory().data_ptr() == tensor.data_ptr()  # already pinned: no copy
            assert torch.equal(tensor, patterned(index, 1 * MIB))
    finally:
        loader.shutdown()


def test_small_tensors_are_pinned_too():
    service = MultiProcessingReadingService(2, pin_memory=True)
    loader = DataLoader2(IterableWrapper(range(8)).sharding_filter().map(small_item), reading_service=service)
    try:
        items = list(loader)
    finally:
        loader.shutdown()
    assert sorted(item["index"] for item in items) == list(range(8))
    assert all(item["x"].is_pinned() for item in items)


@pytest.mark.parametrize("mode", ["loop_copies", "device"])
def test_no_item_is_corrupted_while_workers_reuse_extents_at_full_speed(mode):
    """The loop drops each host tensor right after its non-blocking copy; workers refill
    extents as fast as they can. Every item on the GPU must equal what its worker made."""
    count, nbytes = 96, 4 * MIB
    device = "cuda" if mode == "device" else None
    service = MultiProcessingReadingService(4, pin_memory=True, device=device)
    loader = DataLoader2(make_pipe(count, nbytes), reading_service=service)
    on_gpu: dict[int, torch.Tensor] = {}
    try:
        for index, tensor in loader:
            if mode == "loop_copies":
                tensor = tensor.to("cuda", non_blocking=True)
            on_gpu[index] = tensor
            del tensor
        torch.cuda.synchronize()
        stats = service.stats()
    finally:
        loader.shutdown()
    assert sorted(on_gpu) == list(range(count))
    bad = [i for i, t in on_gpu.items() if not torch.equal(t.cpu(), patterned(i, nbytes))]
    assert bad == []
    if mode == "device":
        assert stats.device is not None and stats.device.bytes_to_device == count * nbytes


def test_a_child_forked_after_registration_reads_the_lent_bytes():
    service = MultiProcessingReadingService(1, pin_memory=True)
    loader = DataLoader2(make_pipe(2, 1 * MIB), reading_service=service)
    try:
        index, tensor = next(iter(loader))
        assert tensor.is_pinned()
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child reads the inherited (registered) buffer; no CUDA call here
            try:
                os.write(write_end, str(int(tensor.to(torch.int64).sum())).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as answer:
            total = int(answer.read() or b"-1")
        os.waitpid(pid, 0)
        assert total == int(patterned(index, 1 * MIB).to(torch.int64).sum())
    finally:
        loader.shutdown()


def test_shutdown_with_copies_in_flight_returns():
    service = MultiProcessingReadingService(2, pin_memory=True, device="cuda", device_prefetch=4)
    loader = DataLoader2(make_pipe(64, 8 * MIB), reading_service=service)
    iterator = iter(loader)
    next(iterator)
    loader.shutdown()  # copies enqueued ahead are simply dropped; nothing waits on them


class filled_int64:
    """A picklable ``index -> (index, tensor of index + 1)``: any byte of another item in
    it changes the tensor's sum."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __call__(self, index: int) -> tuple[int, torch.Tensor]:
        return index, torch.full((self.nbytes // 8,), index + 1, dtype=torch.int64)


def test_batches_dropped_at_once_under_slow_kernels_are_never_overwritten():
    """device="cuda" without an index: the loop's stream sleeps before each read and the
    batch is dropped at once, while the side stream copies the next items. A block reused
    before the loop's read would add another item's values to the total."""
    count, nbytes = 64, 4 * MIB
    service = MultiProcessingReadingService(4, pin_memory=True, device="cuda", device_prefetch=4)
    loader = DataLoader2(IterableWrapper(range(count)).sharding_filter().map(filled_int64(nbytes)), reading_service=service)
    total = torch.zeros((), dtype=torch.int64, device="cuda")
    seen = []
    try:
        for index, batch in loader:
            torch.cuda._sleep(5_000_000)  # a slow kernel on the loop's stream before the read
            total += batch.sum()
            seen.append(index)
            del batch
        got = int(total)
    finally:
        loader.shutdown()
    assert sorted(seen) == list(range(count))
    assert got == (nbytes // 8) * sum(index + 1 for index in range(count))


def unregistrable_range(nbytes: int) -> int:
    """The address of ``nbytes`` that were mapped and are no longer: CUDA refuses them."""
    import mmap

    import numpy as np

    mapping = mmap.mmap(-1, nbytes)
    view = np.frombuffer(mapping, dtype=np.uint8)
    address = view.ctypes.data
    del view
    mapping.close()
    return address


def test_a_refused_registration_warns_once_and_the_next_kernel_runs():
    from mprs_plus.runtime.main.feeding import CudaPageLocker

    locker = CudaPageLocker(device=torch.cuda.current_device())
    with pytest.warns(RuntimeWarning, match="refused") as caught:
        assert locker.register(unregistrable_range(8 * MIB), 8 * MIB) is False
        assert locker.register(unregistrable_range(8 * MIB), 8 * MIB) is False
    assert len(caught) == 1
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)  # raised CUDA's pending error before
    assert float((x * 2).sum()) == float(x.double().sum() * 2)


def test_items_are_intact_and_pinned_when_every_registration_is_refused(monkeypatch):
    from mprs_plus.runtime.main import feeding

    register = feeding.CudaCalls.host_register

    def refused(self, address, nbytes, flags):
        return register(self, unregistrable_range(nbytes), nbytes, flags)

    monkeypatch.setattr(feeding.CudaCalls, "host_register", refused)
    monkeypatch.setattr(feeding, "_the_locker", None)  # a locker of this test's own, that has not warned yet
    service = MultiProcessingReadingService(2, pin_memory=True)
    loader = DataLoader2(make_pipe(16, 1 * MIB), reading_service=service)
    try:
        with pytest.warns(RuntimeWarning, match="refused"):
            items = [(index, tensor) for index, tensor in loader]
    finally:
        loader.shutdown()
    assert sorted(index for index, _ in items) == list(range(16))
    assert all(tensor.is_pinned() and torch.equal(tensor, patterned(index, 1 * MIB)) for index, tensor in items)
    x = torch.ones(1024, device="cuda")
    assert float(x.add_(1).sum()) == 2048.0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_copies_to_another_device_than_the_current_one_are_waited_for():
    """pin_memory=True alone, current device 0, the loop copies to cuda:1 (no set_device)
    behind a slow kernel there and drops the host tensor at once."""
    count, nbytes = 48, 4 * MIB
    service = MultiProcessingReadingService(4, pin_memory=True)
    loader = DataLoader2(make_pipe(count, nbytes), reading_service=service)
    on_gpu: dict[int, torch.Tensor] = {}
    try:
        with torch.cuda.device(0):
            for index, tensor in loader:
                with torch.cuda.device(1):
                    torch.cuda._sleep(5_000_000)
                on_gpu[index] = tensor.to("cuda:1", non_blocking=True)
                del tensor
        torch.cuda.synchronize(1)
    finally:
        loader.shutdown()
    bad = [i for i, t in on_gpu.items() if not torch.equal(t.cpu(), patterned(i, nbytes))]
    assert sorted(on_gpu) == list(range(count)) and bad == []


def test_a_graph_captured_while_another_thread_takes_items_stays_valid():
    """torch.cuda.graph captures in CUDA's global mode by default: a call another thread
    makes meanwhile without relaxing its own mode (an event query, a registration) would
    invalidate the capture, and capture_end would raise. A second thread takes items
    (the first lend's registration, fences, queries) while this one captures."""
    count = 16
    service = MultiProcessingReadingService(2, pin_memory=True)
    loader = DataLoader2(make_pipe(count, 1 * MIB), reading_service=service)
    iterator = iter(loader)  # the workers exist before the capture
    static = torch.ones(1024, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    go, done = threading.Event(), threading.Event()
    taken: list[int] = []
    errors: list[BaseException] = []

    def take() -> None:
        try:
            if go.wait(60):
                for index, tensor in iterator:
                    taken.append(index)
                    del tensor  # dropped at once: a fence, and queries at the next look
        except BaseException as exc:  # raised in the test's thread below
            errors.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=take)
    thread.start()
    try:
        with torch.cuda.graph(graph):
            out = static * 2
            go.set()
            assert done.wait(120), "the taking thread did not finish"
        graph.replay()
        torch.cuda.synchronize()
    finally:
        go.set()
        thread.join(60)
        loader.shutdown()
    assert errors == []
    assert sorted(taken) == list(range(count))
    assert float(out.sum()) == 2048.0


def test_a_lend_area_is_locked_only_as_far_as_it_is_used():
    """One worker, 1 MiB items, a few taken: the channel's area (256 MiB) is page-locked in
    the chunks its buffers were lent from, not whole; every lent tensor is pinned."""
    from mprs_plus.transport import _lend

    service = MultiProcessingReadingService(1, pin_memory=True)
    loader = DataLoader2(make_pipe(4, 1 * MIB), reading_service=service)
    try:
        items = list(loader)
        receivers = [r for r in list(_lend._holding.receivers) if r.locker is not None]
        locked = sum(r.locked_bytes() for r in receivers)
        whole = sum(r._region.lend_size for r in receivers)
    finally:
        loader.shutdown()
    assert all(tensor.is_pinned() and torch.equal(tensor, patterned(index, 1 * MIB)) for index, tensor in items)
    assert receivers and 0 < locked < whole


def test_the_capture_mode_guard_is_found_where_torch_loaded_cudas_runtime():
    from mprs_plus.runtime.main import feeding

    torch.ones(1, device="cuda")
    assert feeding._capture_mode_exchange() is not None, "no libcudart with cudaThreadExchangeStreamCaptureMode"
