"""``seeding="batch"`` and the restores it allows: the same batches, augmentations included,
for any worker count; a state restored at another count or another world size. Compared with
the same run at a fixed count, and with torch's DataLoader (its sampler's order and base
seed) where torch can make the run."""

import itertools
import json
import random
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import DistributedSampler, IterableDataset, default_collate

import mprs_plus
from elastic_datasets import Augmented, Indices, rows
from mprs_plus.dataloader.batch_seeds import BatchSeeds, Kept

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore:This DataLoader will create")]
N = 30  # samples; batches of 4: 8 batches, the last of 2


def loader(workers, **kwargs):
    kwargs.setdefault("batch_size", 4)
    kwargs.setdefault("shuffle", True)
    return mprs_plus.DataLoader(kwargs.pop("dataset", Augmented(N)), num_workers=workers, seeding="batch", **kwargs)


def run(workers, epochs=2, **kwargs):
    torch.manual_seed(0)
    made = loader(workers, **kwargs)
    return [[rows(batch) for batch in made] for _ in range(epochs)]


def by_torch(epochs=2, batch_size=4):
    """The batches seeding="batch" promises, made by hand from torch's own loader: its index
    batches and base seed, each batch seeded from (base seed, epoch, rank 0, its place)."""
    torch.manual_seed(0)
    indices = TorchDataLoader(Indices(N), batch_size=batch_size, shuffle=True)
    dataset, kept, out = Augmented(N), Kept(), []
    for epoch in range(epochs):
        iterator = iter(indices)
        seeds = BatchSeeds(iterator._base_seed, epoch, 0)
        batches = []
        for position, batch in enumerate(iterator):
            kept.keep()
            seeds.apply(position)
            batches.append(rows(default_collate([dataset[i] for i in batch.tolist()])))
            kept.give_back()
        out.append(batches)
    return out


def test_the_same_batches_for_0_1_and_3_workers_and_as_ready():
    expected = by_torch()
    assert expected[0] != expected[1]  # a new epoch draws anew
    for workers in (0, 1, 3):
        assert run(workers) == expected, f"num_workers={workers}"
    assert 'seeding="batch"' in loader(2).explain()
    as_ready = run(3, in_order=False)
    assert [sorted(epoch) for epoch in as_ready] == [sorted(epoch) for epoch in expected]


def test_worker_seeding_stays_torchs():
    torch.manual_seed(0)
    ours = [rows(b) for b in mprs_plus.DataLoader(Augmented(N), batch_size=4, shuffle=True, num_workers=2)]
    torch.manual_seed(0)
    theirs = [rows(b) for b in TorchDataLoader(Augmented(N), batch_size=4, shuffle=True, num_workers=2)]
    assert ours == theirs
    with pytest.raises(ValueError, match='seeding must be "worker"'):
        mprs_plus.DataLoader(Augmented(N), seeding="sample")


def test_without_workers_the_trainers_generators_are_left_as_they_were():
    def draws():
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    made = loader(0, shuffle=False)  # no draw of the loader's own: only the batches could move them
    iterator = iter(made)
    expected_after_iter = (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state().tolist())
    for _ in iterator:
        pass
    assert (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state().tolist()) == expected_after_iter
    after = draws()
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    iter(TorchDataLoader(Indices(N), batch_size=4))  # torch's iter() draws the base seed, as ours did
    assert draws() == after


def ranks_draws(loader_class, **kwargs):
    out = []
    for rank in (0, 1):
        torch.manual_seed(0)  # every rank seeded alike, as a training script does
        sampler = DistributedSampler(Augmented(N), num_replicas=2, rank=rank, shuffle=False)
        made = loader_class(Augmented(N), batch_size=4, sampler=sampler, num_workers=1, **kwargs)
        out.append([row[1:] for batch in made for row in rows(batch)])
    return out


def test_ranks_never_share_draws():
    theirs = ranks_draws(TorchDataLoader)
    assert theirs[0] == theirs[1]  # torch's: worker 0 of every rank draws alike
    ours = ranks_draws(mprs_plus.DataLoader, seeding="batch")
    assert not set(ours[0]) & set(ours[1])


def take(made, k):
    iterator = iter(made)
    head = [rows(next(iterator)) for _ in range(k)]
    return head, json.loads(json.dumps(made.state_dict())), iterator


def rest_of(workers, state, epochs=2, **kwargs):
    torch.manual_seed(99)  # the state, not the global seed, decides what comes
    restored = loader(workers, **kwargs)
    restored.load_state_dict(state)
    return [[rows(batch) for batch in restored] for _ in range(epochs)]


@pytest.mark.parametrize("k", [3, 8])  # mid-epoch; after the epoch's last batch
def test_a_state_taken_at_2_workers_restores_at_3_0_and_1(k):
    expected = by_torch(2)
    torch.manual_seed(0)
    made = loader(2)
    head, state, iterator = take(made, k)
    del iterator, made
    for workers in (3, 0, 1):
        assert head + [b for epoch in rest_of(workers, state) for b in epoch] == [b for e in expected for b in e][:16], workers


def test_a_restored_states_own_state_restores_at_yet_another_count():
    expected = [b for epoch in by_torch(2) for b in epoch]
    torch.manual_seed(0)
    head, state, iterator = take(loader(2), 3)
    del iterator
    restored = loader(3)
    restored.load_state_dict(state)
    more, state, iterator = take(restored, 2)  # a state of the restored epoch (over 3 workers' deal)
    del iterator, restored
    rest = rest_of(0, state)
    assert head + more + rest[0] + rest[1] == expected


def test_a_state_taken_as_ready_restores_the_rest_once_at_another_count():
    expected = by_torch(1)[0]
    torch.manual_seed(0)
    made = loader(2, in_order=False)
    head, state, iterator = take(made, 3)
    del iterator, made
    for workers in (3, 0):
        rest = rest_of(workers, state, epochs=1, in_order=False)[0]
        assert sorted(head + rest) == sorted(expected), workers


def test_worker_seeding_refuses_another_count_and_names_the_way():
    torch.manual_seed(0)
    made = mprs_plus.DataLoader(Augmented(N), batch_size=4, num_workers=2)
    head, state, iterator = take(made, 1)
    del iterator
    with pytest.raises(ValueError, match='num_workers 2 in the state, 3 here.*seeding="batch"'):
        mprs_plus.DataLoader(Augmented(N), batch_size=4, num_workers=3).load_state_dict(state)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(12))


def test_an_iterable_dataset_refuses_another_count_mid_epoch_not_between_epochs():
    made = loader(2, dataset=Stream(), shuffle=None)
    iterator = iter(made)
    next(iterator)
    state = made.state_dict()
    del iterator
    with pytest.raises(ValueError, match="iterable dataset shards itself by worker"):
        loader(3, dataset=Stream(), shuffle=None).load_state_dict(state)
    between = loader(2, dataset=Stream(), shuffle=None).state_dict()
    other = loader(0, dataset=Stream(), shuffle=None)
    other.load_state_dict(between)
    assert sorted(i for batch in other for i in batch.tolist()) == list(range(12))


def rank_loader(world, rank, workers, n=50, epoch=0, seeding="batch"):
    sampler = DistributedSampler(Indices(n), num_replicas=world, rank=rank, shuffle=True, seed=7)
    sampler.set_epoch(epoch)
    return mprs_plus.DataLoader(Indices(n), batch_size=3, sampler=sampler, num_workers=workers, seeding=seeding)


def test_a_world_size_of_4_resumed_at_3_makes_every_remaining_sample_once():
    """Four ranks stop after 2 batches each; the state of rank 1 (any rank's) restores each
    of 3 ranks: the rest of the epoch split over them, then the next epoch is a 3-rank run's."""
    n = 50  # 13 samples a rank at 4 (2 of them padding), 17 at 3
    made = []
    for rank in range(4):
        torch.manual_seed(0)
        before = rank_loader(4, rank, workers=0)
        iterator = iter(before)
        made += [i for _ in range(2) for i in next(iterator).tolist()]
        if rank == 1:
            state = json.loads(json.dumps(before.state_dict()))
    assert len(made) == 24 and len(set(made)) == 24
    after, following = [], []
    for rank in range(3):
        torch.manual_seed(0)
        resumed = rank_loader(3, rank, workers=(0, 2, 3)[rank])  # any worker count, too
        resumed.load_state_dict(state)
        rank_batches = [batch.tolist() for batch in resumed]
        after.append(rank_batches)
        resumed.sampler.set_epoch(1)
        following.append([i for batch in resumed for i in batch.tolist()])
    assert len({len(batches) for batches in after}) == 1  # the ranks step together
    rest = [i for batches in after for batch in batches for i in batch]
    assert sorted(set(made) | set(rest)) == list(range(n))  # every sample of the epoch
    assert not set(made) & set(rest)
    assert len(rest) - len(set(rest)) < 3  # each once, but padding to a multiple of 3 ranks
    for rank in range(3):  # the next epoch: the 3-rank run's own
        sampler = DistributedSampler(Indices(n), num_replicas=3, rank=rank, shuffle=True, seed=7)
        sampler.set_epoch(1)
        assert following[rank] == list(sampler)


def test_a_resumed_remainder_is_itself_resumed_at_another_world_size():
    """torch's seeding too: another world size needs only positions of the sampler's order."""
    n = 50
    made = []
    for rank in range(4):
        before = rank_loader(4, rank, workers=0, seeding="worker")
        iterator = iter(before)
        made += [i for _ in range(2) for i in next(iterator).tolist()]
        state = before.state_dict()
    middle = []
    for rank in range(3):
        resumed = rank_loader(3, rank, workers=0, seeding="worker")
        resumed.load_state_dict(state)
        iterator = iter(resumed)
        middle += [i for _ in range(2) for i in next(iterator).tolist()]
        if rank == 2:
            state = resumed.state_dict()
    rest = []
    for rank in range(2):
        last = rank_loader(2, rank, workers=0, seeding="worker")
        last.load_state_dict(state)
        rest += [i for batch in last for i in batch.tolist()]
    assert not set(made) & set(middle) and not set(made + middle) & set(rest)
    assert sorted(set(made + middle + rest)) == list(range(n))


def draws_run(workers, dataset, **kwargs):
    from restart_datasets import read_through

    torch.manual_seed(0)
    made = mprs_plus.DataLoader(dataset, batch_size=4, num_workers=workers, seeding="batch", **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the replacements' own warnings: test_worker_restarts.py checks them
        got, errors = read_through(made, lambda batch: batch.tolist())
    return got, errors, made.stats().replacements if workers else ()


def test_a_replacement_worker_makes_the_uninterrupted_runs_batches(tmp_path):
    from restart_datasets import Draws

    expected, _, _ = draws_run(0, Draws())
    got, errors, made = draws_run(2, Draws(kill_at=18, marker=str(tmp_path / "killed")), worker_restarts=1)
    assert (tmp_path / "killed").exists() and len(made) == 1
    assert got == expected and not errors


def test_a_poison_sample_leaves_every_other_batch_unchanged():
    """Index 29 (batch 7) kills every worker that reads it: under torch's seeding the dead
    worker's later batches draw otherwise (test_worker_restarts.py); here every batch but
    the poisoned one is the uninterrupted run's."""
    from restart_datasets import Draws

    expected, _, _ = draws_run(0, Draws())
    got, errors, made = draws_run(2, Draws(kill_at=29, poison=True), worker_restarts=2)
    assert len(errors) == 1 and "indices [28, 29, 30, 31]" in str(errors[0])
    assert [m.poison for m in made] == [False, True]
    assert got[7] is None
    assert got[:7] + got[8:] == expected[:7] + expected[8:]


def test_another_world_size_without_a_distributed_sampler_is_refused():
    made = mprs_plus.DataLoader(Indices(50), batch_size=3, num_workers=0, seeding="batch")
    iterator = iter(made)
    next(iterator)
    state = made.state_dict()  # a world of 1: no DistributedSampler, no process group
    with pytest.raises(ValueError, match="world size of 1, this process is one of 2"):
        rank_loader(2, 0, workers=0).load_state_dict(state)


def test_the_rank_of_an_initialised_process_group_is_part_of_the_seeds(monkeypatch):
    """Without a DistributedSampler, the rank comes from torch.distributed (faked here: the
    process group's own test is test_distributed.py's)."""
    import torch.utils.data.dataloader as torch_loader

    first = run(0, epochs=1, shuffle=False)[0]
    monkeypatch.setattr(torch_loader, "_get_distributed_settings", lambda: (2, 1))
    second = run(0, epochs=1, shuffle=False)[0]
    assert [[row[0] for row in b] for b in first] == [[row[0] for row in b] for b in second]
    assert not {row[1:] for b in first for row in b} & {row[1:] for b in second for row in b}


def test_the_three_generators_draw_streams_of_their_own():
    """random and numpy's legacy generator are both MT19937: seeded with the same words they
    would draw the same numbers."""
    batch = run(0, epochs=1, shuffle=False)[0][0]
    python, numpy_, torch_ = zip(*(row[1:] for row in batch))
    assert len(set(python) | set(numpy_) | set(torch_)) == 3 * len(batch)


def test_a_layout_folds_any_deal_into_positions():
    from mprs_plus.dataloader.elastic import Layout

    fresh = Layout()
    assert fresh.fold(2, [3, 2]) == Layout(5, ())  # in order: the first 5 batches
    assert fresh.fold(2, [3, 1]) == Layout(3, (4,))  # as ready: worker 0 ran ahead
    assert fresh.fold(0, [4]) == Layout(4, ())  # the loop's own process: one worker
    left = Layout(3, (4,))
    assert left.deal(10, 3) == [[3, 7], [5, 8], [6, 9]]
    assert left.fold(3, [1, 1, 0]) == Layout(6, ())  # 3 and 5 made: 6 is next
    assert left.fold(3, [0, 1, 1]) == Layout(3, (4, 5, 6))
    assert list(itertools.islice(Layout(3, (4, 6)).remaining(), 3)) == [3, 5, 7]


class CountsOn(IterableDataset):
    """An iterable dataset with a state of its own: where it is in its shard, and a draw."""

    def __init__(self):
        self.next = 0

    def __iter__(self):
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        step, start = (1, 0) if info is None else (info.num_workers, info.id)
        while self.next * step + start < 20:
            i = self.next * step + start
            self.next += 1
            yield torch.tensor([float(i), float(torch.rand(()))])
        self.next = 0

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"]


@pytest.mark.parametrize("before, after", [(0, 1), (1, 0)])
def test_an_iterable_datasets_state_moves_between_0_and_1_worker(before, after):
    """One replica either way: the loop's own process is worker 0 of 1."""
    def make(workers):
        return mprs_plus.DataLoader(CountsOn(), batch_size=3, num_workers=workers, seeding="batch")

    torch.manual_seed(0)
    expected = [b.tolist() for b in make(before)]
    torch.manual_seed(0)
    made = make(before)
    iterator = iter(made)
    head = [next(iterator).tolist() for _ in range(3)]
    state = json.loads(json.dumps(made.state_dict()))
    del iterator
    restored = make(after)
    restored.load_state_dict(state)
    assert head + [b.tolist() for b in restored] == expected
