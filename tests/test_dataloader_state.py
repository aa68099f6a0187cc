"""mprs_plus.DataLoader's state_dict()/load_state_dict(): a state taken at any batch restores,
in a new loader built the same way, to exactly the rest of the uninterrupted run."""

import json
import random

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

from mprs_plus import DataLoader
from loader_datasets import Randomized, gen, plain

pytestmark = pytest.mark.timeout(180)


class Squares(Dataset):
    """Deterministic samples: in the main process the samples' randomness would be the
    user's own generators, which no loader records."""

    def __len__(self):
        return 20

    def __getitem__(self, i):
        return {"index": i, "square": torch.tensor([i * i])}


def seed_all(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def check_every_batch(make, epochs=2):
    """For every k: k batches, state_dict(), a new loader restored from it yields the rest
    of the epoch and then the next epochs of the uninterrupted run."""
    seed_all(5)
    reference = make()
    full = [[plain(batch) for batch in reference] for _ in range(epochs)]
    for k in range(len(full[0]) + 1):
        seed_all(5)
        loader = make()
        batches = iter(loader)
        head = [plain(next(batches)) for _ in range(k)]
        state = json.loads(json.dumps(loader.state_dict()))  # plain data: JSON keeps all of it
        del batches, loader
        seed_all(99)  # the restore, not the global seed, must decide what comes
        restored = make()
        restored.load_state_dict(state)
        rest = [[plain(batch) for batch in restored] for _ in range(epochs)]
        assert head + rest[0] == full[0], f"epoch after a state at batch {k}"
        assert rest[1:] == full[1:], f"later epochs after a state at batch {k}"


@pytest.mark.parametrize("generator", [False, True])
def test_every_batch_in_process(generator):
    check_every_batch(lambda: DataLoader(Squares(), batch_size=3, shuffle=True, generator=gen() if generator else None))


@pytest.mark.parametrize("generator", [False, True])
def test_every_batch_with_workers_and_their_randomness(generator):
    check_every_batch(
        lambda: DataLoader(Randomized(), batch_size=3, shuffle=True, num_workers=2, generator=gen() if generator else None)
    )


def test_every_batch_as_ready():
    """in_order=False: the same set of batches, the rest of the epoch exactly once."""
    seed_all(5)
    loader = DataLoader(Randomized(), batch_size=2, num_workers=2, in_order=False)
    batches = iter(loader)
    head = [next(batches)["index"].tolist() for _ in range(4)]
    state = loader.state_dict()
    del batches, loader
    restored = DataLoader(Randomized(), batch_size=2, num_workers=2, in_order=False)
    restored.load_state_dict(state)
    rest = [batch["index"].tolist() for batch in restored]
    assert sorted(i for batch in head + rest for i in batch) == list(range(23))


class EpochSampler(Sampler):
    """A sampler with state: its epoch number decides its order (as a DistributedSampler's)."""

    def __init__(self, n):
        self.n = n
        self.epoch = 0

    def __len__(self):
        return self.n

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(100 + self.epoch)).tolist()
        self.epoch += 1
        return iter(order)

    def state_dict(self):
        return {"epoch": self.epoch}

    def load_state_dict(self, state):
        self.epoch = state["epoch"]


def test_a_sampler_with_state_is_restored():
    def make():
        return DataLoader(Squares(), batch_size=4, sampler=EpochSampler(20), num_workers=2)

    seed_all(5)
    reference = make()
    full = [[plain(b) for b in reference] for _ in range(3)]
    loader = make()
    list(loader)
    batches = iter(loader)
    head = [plain(next(batches)) for _ in range(2)]
    state = loader.state_dict()
    del batches, loader
    restored = make()
    restored.load_state_dict(state)
    assert head + [plain(b) for b in restored] == full[1]
    assert [plain(b) for b in restored] == full[2]


class Counter(IterableDataset):
    """Each worker counts its own numbers; its state is where it is, and whether it was loaded."""

    def __init__(self):
        self.position = 0
        self.loaded = False

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        limit = 11 + 3 * worker
        while self.position < limit:
            value = self.position * workers + worker
            self.position += 1
            yield {"value": value, "loaded": self.loaded}
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]
        self.loaded = True


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("every", [1, 2])
def test_an_iterable_dataset_state_is_taken_in_each_worker(workers, every):
    def make():
        return DataLoader(Counter(), batch_size=2, num_workers=workers, snapshot_every_n_steps=every)

    def values(batch):
        return batch["value"].tolist()

    full = [values(b) for b in make()]
    for k in range(1, len(full)):
        loader = make()
        batches = iter(loader)
        head = [values(next(batches)) for _ in range(k)]
        state = json.loads(json.dumps(loader.state_dict()))
        del batches, loader
        restored = make()
        restored.load_state_dict(state)
        rest = list(restored)
        assert head + [values(b) for b in rest] == full, k
        if every == 1 or workers == 0:
            # a worker that had handed out batches goes on from its dataset's loaded state:
            # nothing of its epoch is replayed
            started = {batch[0] % max(workers, 1) for batch in head}
            for batch in rest:
                worker = batch["value"][0].item() % max(workers, 1)
                assert batch["loaded"].all() == (worker in started)


@pytest.mark.parametrize(
    "changed",
    [
        {"batch_size": 4},
        {"num_workers": 0},
        {"dataset": Randomized(22)},
    ],
)
def test_a_state_of_another_loader_is_a_value_error(changed):
    arguments = {"dataset": Randomized(), "batch_size": 3, "num_workers": 2}
    loader = DataLoader(**arguments)
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    del batches, loader
    other = DataLoader(**{**arguments, **changed})
    with pytest.raises(ValueError, match="built differently"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="state_dict"):
        other.load_state_dict({"not": "ours"})


def test_every_batch_with_a_sampler_without_len():
    from loader_datasets import Unsized

    check_every_batch(lambda: DataLoader(Randomized(), batch_size=3, sampler=Unsized(23, 4), num_workers=2))


def test_persistent_workers_restore_in_their_first_epoch_and_between_epochs():
    check_every_batch(lambda: DataLoader(Randomized(), batch_size=4, shuffle=True, num_workers=2, persistent_workers=True))

    def make():
        return DataLoader(Squares(), batch_size=4, shuffle=True, num_workers=2, persistent_workers=True)

    seed_all(5)
    reference = make()
    full = [[plain(b) for b in reference] for _ in range(3)]
    seed_all(5)
    loader = make()
    list(loader)
    state = loader.state_dict()  # between epochs: what the next one draws from
    del loader
    seed_all(99)
    restored = make()
    restored.load_state_dict(state)
    assert [[plain(b) for b in restored] for _ in range(2)] == full[1:]


class DrawsWithState(Dataset):
    """A map-style dataset with state, as StatefulDataLoader's tests write them: its state
    is the worker's generator, so a restore that loads it draws on from there."""

    def __init__(self):
        self.loaded = 0

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return {"index": i, "draw": torch.rand(1), "loaded": self.loaded}

    def state_dict(self):
        return {"rng": torch.get_rng_state().tolist()}

    def load_state_dict(self, state):
        torch.set_rng_state(torch.tensor(state["rng"], dtype=torch.uint8))
        self.loaded += 1


@pytest.mark.parametrize("workers", [0, 2])
def test_a_map_style_dataset_state_is_taken_and_loaded(workers):
    def make(every=1):
        return DataLoader(DrawsWithState(), batch_size=2, shuffle=True, num_workers=workers, snapshot_every_n_steps=every)

    def plain_of(batch):
        return batch["index"].tolist(), batch["draw"].tolist()

    seed_all(3)
    full = [plain_of(b) for b in make()]
    for every in (1, 4):
        for k in (1, 5, 9):
            seed_all(3)
            loader = make(every)
            batches = iter(loader)
            head = [plain_of(next(batches)) for _ in range(k)]
            state = loader.state_dict()
            del batches, loader
            restored = make(every)
            restored.load_state_dict(state)
            rest = list(restored)
            assert head + [plain_of(b) for b in rest] == full, (every, k)
            if every == 1 and k >= workers:  # every worker had a state recorded: each loaded it
                assert all(bool(b["loaded"].eq(1).all()) for b in rest)


def test_persistent_workers_carry_their_dataset_state_between_epochs():
    """State taken between epochs restores a persistent worker's dataset as the epoch left it."""

    def make():
        return DataLoader(DrawsWithState(), batch_size=3, num_workers=2, persistent_workers=True)

    seed_all(3)
    reference = make()
    full = [[b["draw"].tolist() for b in reference] for _ in range(2)]
    seed_all(3)
    loader = make()
    list(loader)
    state = loader.state_dict()
    del loader
    restored = make()
    restored.load_state_dict(state)
    assert [b["draw"].tolist() for b in restored] == full[1]


# -- a state taken before the first batch, or before iter() at all (StatefulDataLoader allows both)


def _identity(batch):
    return batch


@pytest.mark.parametrize("workers, persistent", [(0, False), (2, False), (2, True)])
def test_a_state_taken_before_iter_restores_to_the_start(workers, persistent):
    def make():
        return DataLoader(Squares(), batch_size=3, shuffle=True, num_workers=workers, persistent_workers=persistent)

    seed_all(5)
    loader = make()
    initial = loader.state_dict()  # before iter(): the next epoch's draws start from here
    epochs = [[plain(b) for b in loader] for _ in range(2)]
    batches = iter(loader)
    next(batches), next(batches)
    loader.load_state_dict(initial)  # the same loader, mid-epoch
    assert loader.state_dict() == initial  # until the next iter(), the state is the loaded one
    assert [[plain(b) for b in loader] for _ in range(2)] == epochs
    seed_all(99)
    fresh = make()
    fresh.load_state_dict(json.loads(json.dumps(initial)))  # a new loader built the same way
    assert [[plain(b) for b in fresh] for _ in range(2)] == epochs


@pytest.mark.parametrize("workers, persistent", [(0, False), (2, False), (2, True)])
def test_a_state_loaded_into_a_loader_that_took_none_yet(workers, persistent):
    def make():
        return DataLoader(Squares(), batch_size=3, shuffle=True, num_workers=workers, persistent_workers=persistent)

    for taken_at in (0, 2, 5):
        seed_all(5)
        loader = make()
        batches = iter(loader)
        for _ in range(taken_at):
            next(batches)
        state = loader.state_dict()
        rest = [plain(b) for b in batches]
        del batches, loader
        seed_all(99)
        restored = make()
        assert restored.state_dict() != state  # its own initial state, taken before loading
        restored.load_state_dict(state)
        assert restored.state_dict() == state
        assert [plain(b) for b in restored] == rest, taken_at


def _loader_class(cls):
    """The class a side-by-side test runs: torchdata's ``StatefulDataLoader``, or ours."""
    if cls == "StatefulDataLoader":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader
    return DataLoader


class OwnIterator(IterableDataset):
    """Its own iterator, set up by ``__iter__`` (torchdata's tests' ``CountIterCallsIter``):
    its state only loads once ``iter()`` was called. Every sample says how many times
    ``__iter__`` ran in its process."""

    def __init__(self, length=60):
        self.length = length
        self.iter_calls = 0

    def __iter__(self):
        self.iter_calls += 1
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        share = self.length // workers
        self.position, self.end = share * worker, share * (worker + 1)
        return self

    def __next__(self):
        if self.position >= self.end:
            raise StopIteration
        self.position += 1
        return self.position - 1, self.iter_calls

    def state_dict(self):
        return {"position": self.position, "end": self.end}

    def load_state_dict(self, state):
        self.position, self.end = state["position"], state["end"]


@pytest.mark.parametrize("cls", ["StatefulDataLoader", "mprs_plus"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_that_is_its_own_iterator_restores_and_is_iterated_once(cls, workers):
    make = _loader_class(cls)
    loader = make(OwnIterator(), num_workers=workers, collate_fn=_identity)
    batches = iter(loader)
    head = [sample for _ in range(40) for sample in next(batches)]  # batches of one sample
    state = loader.state_dict()
    del batches, loader
    restored = make(OwnIterator(), num_workers=workers, collate_fn=_identity)
    restored.load_state_dict(state)
    rest = [sample for batch in restored for sample in batch]
    assert sorted(value for value, _ in head + rest) == list(range(60))
    assert {calls for _, calls in rest} == {1}  # iter() once in each process, after the restore too


class CountsEpochs(IterableDataset):
    """Worker ``k`` (0 without workers) reads its own range of ``sizes[k]`` samples, and
    an epoch counter is kept after the last ``yield``: the dataset's state changes once its
    iterator is exhausted."""

    def __init__(self, sizes=(5,)):
        self.sizes = sizes
        self.epoch, self.position, self.resume = 0, 0, 0

    def __iter__(self):
        info = get_worker_info()
        worker = info.id if info is not None else 0
        start = sum(self.sizes[:worker])
        self.position, self.resume = self.resume, 0
        for i in range(start + self.position, start + self.sizes[worker]):
            self.position += 1
            yield (i, self.epoch)
        self.position, self.epoch = 0, self.epoch + 1

    def state_dict(self):
        return {"position": self.position, "epoch": self.epoch}

    def load_state_dict(self, state):
        self.resume, self.epoch = state["position"], state["epoch"]


@pytest.mark.parametrize("cls", ["StatefulDataLoader", "mprs_plus"])
def test_without_workers_a_state_between_epochs_carries_the_dataset_as_its_epoch_ended(cls):
    make = _loader_class(cls)
    loader = make(CountsEpochs(), num_workers=0, collate_fn=_identity)
    list(loader)
    state = loader.state_dict()
    expected = [list(loader), list(loader)]
    restored = make(CountsEpochs(), num_workers=0, collate_fn=_identity)
    batches = iter(restored)
    next(batches)  # a loader part-way through an epoch takes the state all the same
    restored.load_state_dict(state)
    assert [list(restored), list(restored)] == expected
    assert expected[0][0] == [(0, 1)]  # the second epoch, as the dataset counted it


@pytest.mark.parametrize("cls, in_order", [("StatefulDataLoader", True), ("mprs_plus", True), ("mprs_plus", False)])
def test_persistent_workers_carry_the_dataset_state_their_epoch_ended_with(cls, in_order):
    make_loader = _loader_class(cls)
    order = {} if in_order else {"in_order": False}  # StatefulDataLoader 0.9 reads in order only

    def make():
        dataset = CountsEpochs(sizes=(3, 5))
        return make_loader(dataset, num_workers=2, persistent_workers=True, collate_fn=_identity, **order)

    loader = make()
    first = list(loader)
    state = loader.state_dict()
    expected = [sorted(list(loader)), sorted(list(loader))]
    restored = make()
    batches = iter(restored)
    next(batches)
    restored.load_state_dict(state)
    assert [sorted(list(restored)), sorted(list(restored))] == expected
    assert sorted(first) == [[(i, 0)] for i in range(8)]
    assert expected[0] == [[(i, 1)] for i in range(8)]  # the second epoch, as each replica counted it


class LiveState(IterableDataset):
    """Its ``state_dict()`` hands out its live dict, which every sample changes."""

    def __init__(self):
        self.flips, self.step = {0: 0, 1: 0, 2: 0}, 0

    def __iter__(self):
        while self.step < 30:
            self.step += 1
            self.flips[self.step % 3] = 1 - self.flips[self.step % 3]
            yield (self.step, self.flips[self.step % 3])

    def state_dict(self):
        return {"flips": self.flips, "step": self.step}

    def load_state_dict(self, state):
        self.flips, self.step = dict(state["flips"]), state["step"]


# StatefulDataLoader 0.9 without workers hands back the dataset's live dict: it is not
# compared there.
@pytest.mark.parametrize("cls, workers", [("StatefulDataLoader", 2), ("mprs_plus", 0), ("mprs_plus", 2)])
def test_a_dataset_state_is_taken_as_it_was_at_its_batch(cls, workers):
    make_loader = _loader_class(cls)

    def make():
        return make_loader(LiveState(), num_workers=workers, collate_fn=_identity)

    loader = make()
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    state = loader.state_dict()
    rest = list(batches)  # the datasets go on changing the dicts they handed out
    restored = make()
    restored.load_state_dict(state)
    assert list(restored) == rest


class ItsOwnIterator:
    """An iterator with a state of its own, apart from its dataset (torchdata's tests'
    ``DummyIterator``): where it is, and the worker's generator it draws its order from."""

    def __init__(self, items):
        self.items, self.i = items, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= len(self.items):
            raise StopIteration
        self.i += 1
        return self.items[torch.randint(len(self.items), (1,)).item()]

    def state_dict(self):
        return {"i": self.i, "rng": torch.get_rng_state().tolist()}

    def load_state_dict(self, state):
        self.i = state["i"]
        torch.set_rng_state(torch.tensor(state["rng"], dtype=torch.uint8))


class MakesItsIterator(IterableDataset):
    """No state of its own: each ``iter()`` makes a new ``ItsOwnIterator`` over the
    worker's share (worker k has 7 + 5k samples)."""

    def __iter__(self):
        info = get_worker_info()
        worker = 0 if info is None else info.id
        start = sum(7 + 5 * w for w in range(worker))
        return ItsOwnIterator(list(range(start, start + 7 + 5 * worker)))


# StatefulDataLoader 0.9 loads the iterator's state into fresh workers too, which then draw
# on from where the last epoch's workers stopped: not compared without persistent workers.
@pytest.mark.parametrize("cls, persistent", [("StatefulDataLoader", True), ("mprs_plus", False), ("mprs_plus", True)])
def test_an_iterator_with_a_state_of_its_own_carries_it_into_the_next_epoch(cls, persistent):
    """A state between epochs restores the next epoch exactly: persistent workers drew from
    their generators in the last epoch, and the iterator's recorded state carries that."""
    make_loader = _loader_class(cls)

    def make():
        return make_loader(MakesItsIterator(), num_workers=2, persistent_workers=persistent, collate_fn=_identity)

    seed_all(4)
    loader = make()
    list(loader)
    state = loader.state_dict()
    expected = list(loader)
    del loader
    seed_all(99)
    restored = make()
    restored.load_state_dict(state)
    assert list(restored) == expected


@pytest.mark.parametrize("workers, persistent", [(0, False), (2, False), (2, True)])
def test_an_iterator_with_a_state_of_its_own_restores_mid_epoch(workers, persistent):
    def make():
        return DataLoader(MakesItsIterator(), num_workers=workers, persistent_workers=persistent, collate_fn=_identity)

    seed_all(4)
    loader = make()
    epochs = [list(loader) for _ in range(2)]
    for k in (1, 3, 6):
        seed_all(4)
        loader = make()
        list(loader)  # a second epoch, after the generators moved in the first
        batches = iter(loader)
        head = [next(batches) for _ in range(k)]
        state = json.loads(json.dumps(loader.state_dict()))
        del batches, loader
        seed_all(99)
        restored = make()
        restored.load_state_dict(state)
        assert head + list(restored) == epochs[1], k
