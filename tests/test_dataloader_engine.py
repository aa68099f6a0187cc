"""What the service's engine gives, through mprs_plus.DataLoader: batches as views of shared
memory, a small /dev/shm, pin_memory without an accelerator, stats() and explain()."""

import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch.utils.data import Dataset

from mprs_plus import DataLoader
from loader_datasets import Randomized, plain, run

pytestmark = pytest.mark.timeout(120)


class Rows(Dataset):
    """Samples of 64 Ki float32 (256 KiB): every collated batch is a large tensor."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.full((64 << 10,), float(i))


def test_large_batches_reach_the_loop_as_views_of_shared_memory():
    loader = DataLoader(Rows(), batch_size=2, num_workers=2)
    seen = 0
    for batch in loader:
        assert batch.shape == (2, 64 << 10)
        assert batch[:, 0].tolist() == [2.0 * seen, 2.0 * seen + 1]
        seen += 1
        del batch  # the lent buffer goes back before the next batch
    large = loader.stats().large_buffers
    assert seen == 12 and large.lent == 12 and large.copied == 0


def test_pin_memory_without_an_accelerator_warns_and_gives_the_same_batches():
    if torch.cuda.is_available():
        pytest.skip("this machine has an accelerator: test_gpu.py covers pin_memory there")

    def make(cls):
        return cls(Randomized(9), batch_size=2, shuffle=True, num_workers=2, pin_memory=True)

    with pytest.warns(UserWarning, match="pin_memory"):
        ours = run(DataLoader, make)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ours == run(torch.utils.data.DataLoader, make)


def test_stats_give_a_verdict_and_explain_shows_the_plan():
    loader = DataLoader(Randomized(), batch_size=4, shuffle=True, num_workers=2)
    assert loader.stats().processes == ()  # before the first epoch: nothing ran
    assert len(list(loader)) == 6
    stats = loader.stats()
    assert sum(p.items_out for p in stats.processes if p.role == "worker") == 6
    assert stats.summary()
    text = loader.explain()
    assert "index batches from BatchSampler" in text and "worker i % 2" in text
    assert "2 workers" in text and "LoaderStage" in text
    assert "No sharding point" not in text


SMALL_SHM_DRIVER = textwrap.dedent(
    """
    import json, os, sys, torch
    from torch.utils.data import Dataset
    from mprs_plus import DataLoader

    class Big(Dataset):
        def __len__(self):
            return 16
        def __getitem__(self, i):
            return torch.full((4 << 20,), i % 251, dtype=torch.uint8)  # 4 MiB: 16 MiB per batch of 4

    if __name__ == "__main__":
        st = os.statvfs("/dev/shm")
        size = st.f_blocks * st.f_frsize
        damaged, count = [], 0
        for k, batch in enumerate(DataLoader(Big(), batch_size=4, num_workers=2)):
            expected = torch.tensor([(4 * k + j) % 251 for j in range(4)], dtype=torch.uint8)
            if not bool((batch == expected[:, None]).all()):
                damaged.append(k)
            count += 1
            del batch
        print(json.dumps({"size": size, "batches": count, "damaged": damaged, "left": os.listdir("/dev/shm")}))
    """
)


def test_large_batches_with_a_tiny_dev_shm(tmp_path):
    from test_small_shm import MOUNT, SHM_MIB, _namespace_refusal

    refusal = _namespace_refusal()
    if refusal is not None:
        pytest.skip(refusal)
    script = tmp_path / "small_shm_loader.py"
    script.write_text(SMALL_SHM_DRIVER)
    command = f'{MOUNT} && exec "$0" -W ignore "$1"'
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", command, sys.executable, str(script)], capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"size": SHM_MIB << 20, "batches": 4, "damaged": [], "left": []}


@pytest.fixture
def fake_device(monkeypatch):
    """The runtime's feeding with test_feeding's fake mover: the real wiring, no device."""
    from test_feeding import FakeMover

    from mprs_plus.runtime.main import feeding

    def open_fake(pin_memory, device, ahead, pin_memory_device=None):
        return feeding.Feeding(device, ahead, mover_factory=FakeMover)

    monkeypatch.setattr(feeding, "open_feeding", open_fake)


@pytest.mark.parametrize("workers", [0, 2])
def test_device_batches_and_a_state_taken_while_batches_are_copied_ahead(fake_device, workers):
    def make():
        return DataLoader(torch.arange(40), batch_size=4, shuffle=True, num_workers=workers, pin_memory=True,
                          device="cuda", generator=torch.Generator().manual_seed(2))

    expected = [batch.tolist() for batch in torch.utils.data.DataLoader(
        torch.arange(40), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2))]
    assert [moved[1].tolist() for moved in make()] == expected  # the fake device tags each batch
    loader = make()
    batches = iter(loader)
    head = [next(batches)[1].tolist() for _ in range(3)]  # more than these were read, to copy ahead
    state = loader.state_dict()
    del batches, loader
    restored = make()
    restored.load_state_dict(state)
    assert head + [moved[1].tolist() for moved in restored] == expected
    if workers:
        assert restored.stats().device.items == 7
