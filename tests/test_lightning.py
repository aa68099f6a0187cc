"""Lightning re-creates a loader with its own sampler (DDP, ``ddp_spawn``) from the call that
made it: ``mprs_plus.DataLoader`` is re-created as itself, with every argument, whether
this class was made before Lightning wrapped torch's ``__init__`` or after (imported
lazily inside ``train_dataloader()``, when only torch's ``__init__`` records the call)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("lightning")
pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent(
    """
    import sys

    import torch
    from lightning.fabric.utilities.data import _replace_dunder_methods, _update_dataloader
    from torch.utils.data import DataLoader as TorchDataLoader
    from torch.utils.data import DistributedSampler

    if sys.argv[1] == "before":
        import mprs_plus
    dataset = [torch.tensor([i]) for i in range(10)]
    wide = [torch.tensor([i]) for i in range(20)]
    # What Lightning does around train_dataloader(): torch's DataLoader and its subclasses
    # known then record the arguments of every loader made inside.
    with _replace_dunder_methods(TorchDataLoader, "dataset"):
        import mprs_plus  # "after": the class is made now, its own __init__ is not recorded

        loader = mprs_plus.DataLoader(dataset, 2, False, num_workers=0, snapshot_every_n_steps=3, collect_stats=False)
        loader.device = None  # set after __init__: Lightning replays it on the copy
        elastic = mprs_plus.DataLoader(wide, 2, False, seeding="batch")
    sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=False)
    copy = _update_dataloader(loader, sampler)

    assert type(copy) is mprs_plus.DataLoader, type(copy)
    assert copy.sampler is sampler and copy.batch_size == 2
    assert (copy.snapshot_every_n_steps, copy.collect_stats) == (3, False)
    assert copy._family is not loader._family and copy._keep is not loader._keep
    expected = [b.tolist() for b in TorchDataLoader(dataset, batch_size=2, sampler=sampler)]
    assert [b.tolist() for b in copy] == expected == [[[1], [3]], [[5], [7]], [[9]]], expected

    # A state of one of 2 ranks, Lightning's re-created loaders, restored by each of 3 ranks:
    # every remaining sample once, none made before again (seeding="batch" replayed on the copies).
    def rank(world, rank):
        sampler = DistributedSampler(wide, num_replicas=world, rank=rank, shuffle=True, seed=3)
        return _update_dataloader(elastic, sampler)

    made = []
    for r in range(2):
        copy = rank(2, r)
        assert copy.seeding == "batch"
        batches = iter(copy)
        made += [i for _ in range(3) for i in next(batches).flatten().tolist()]
        state = copy.state_dict()
    rest = []
    for r in range(3):
        copy = rank(3, r)
        copy.load_state_dict(state)
        rest += [i for batch in copy for i in batch.flatten().tolist()]
    assert not set(made) & set(rest) and sorted(set(made) | set(rest)) == list(range(20)), (made, rest)
    print("re-created")
    """
)


@pytest.mark.parametrize("order", ["before", "after"])
def test_lightning_re_creates_the_loader_as_itself(order, tmp_path):
    """Also with seeding="batch", restored at another world size."""
    path = tmp_path / "recreate.py"
    path.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(path), order], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "re-created"
