"""A ``prefetch_factor`` passed to the loader bounds what the workers fetch ahead of the
loop, as with torch's DataLoader: after the loop received c batches, at most ``c + prefetch_factor * num_workers``
index batches were fetched, and the workers do fetch that far without waiting for the loop.

Counted, not timed: the dataset records, in memory shared with the workers (fork), the
highest index fetched and the first index fetched past the bound the loop published. The
loop publishes the bound before each ``next()`` (counting the batch it is about to
receive, which frees one more), then waits on the dataset's own counter until the workers
have fetched all they may: a loader that runs further ahead gets the time to do so and is
caught in the act, by the dataset, whichever way the processes are scheduled.
"""

import multiprocessing

import pytest
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

from mprs_plus import DataLoader

pytestmark = pytest.mark.timeout(120)

FORK = multiprocessing.get_context("fork")  # the counters reach the workers by inheritance
WAIT_SECONDS = 30.0


class Watched(Dataset):
    """Samples 0..n-1 that record how far the workers fetched."""

    def __init__(self, n):
        self.n = n
        self.changed = FORK.Condition()
        self.highest = FORK.RawValue("q", -1)  # the highest index fetched so far
        self.limit = FORK.RawValue("q", 0)  # the loop's bound: indices below it may be fetched
        self.over = FORK.RawValue("q", -1)  # the first index fetched at or past the bound

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        with self.changed:
            if i >= self.limit.value and self.over.value < 0:
                self.over.value = i
            self.highest.value = max(self.highest.value, i)
            self.changed.notify_all()
        return i

    def publish(self, limit):
        with self.changed:
            self.limit.value = limit

    def wait_fetched(self, count):
        """Wait (bounded) until the samples below ``count`` were fetched; the highest then."""
        with self.changed:
            reached = self.changed.wait_for(lambda: self.highest.value + 1 >= count, timeout=WAIT_SECONDS)
            assert reached, f"the workers fetched up to {self.highest.value}, never the {count} samples they may"
            return self.highest.value + 1


@pytest.mark.parametrize("cls", [TorchDataLoader, DataLoader], ids=["torch", "mprs_plus"])
@pytest.mark.parametrize("prefetch_factor", [1, 2])
def test_the_workers_fetch_prefetch_factor_batches_each_ahead_of_the_loop(cls, prefetch_factor):
    workers, batch_size, batches = 2, 3, 20
    dataset = Watched(batches * batch_size)
    ahead = prefetch_factor * workers  # index batches the workers may fetch beyond those received
    dataset.publish(ahead * batch_size)
    loader = cls(
        dataset, batch_size=batch_size, num_workers=workers, prefetch_factor=prefetch_factor,
        multiprocessing_context="fork",
    )
    iterator = iter(loader)
    try:
        for received in range(batches):
            bound = min(received + ahead, batches) * batch_size
            assert dataset.wait_fetched(bound) == bound, f"fetched past the bound after {received} batches"
            assert dataset.over.value == -1, f"sample {dataset.over.value} fetched after {received} batches"
            dataset.publish((received + 1 + ahead) * batch_size)  # receiving this batch frees one more
            assert next(iterator).tolist() == list(range(received * batch_size, (received + 1) * batch_size))
        assert next(iterator, None) is None
        assert dataset.over.value == -1
    finally:
        del iterator  # a failed assertion's traceback must not keep the workers alive


def test_left_at_its_default_the_workers_run_ahead_as_far_as_their_channels_let_them():
    # torch's attribute still reads 2; the bound holds only where the user asked for it.
    workers, batch_size, batches = 2, 3, 20
    dataset = Watched(batches * batch_size)
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=workers, multiprocessing_context="fork")
    assert loader.prefetch_factor == TorchDataLoader(dataset, batch_size=batch_size, num_workers=workers).prefetch_factor
    dataset.publish(batches * batch_size)
    iterator = iter(loader)
    try:
        # Nothing received yet: the whole epoch is fetched, far past 2 batches per worker.
        assert dataset.wait_fetched(batches * batch_size) == batches * batch_size
        assert [next(iterator).tolist() for _ in range(batches)] == [
            list(range(b * batch_size, (b + 1) * batch_size)) for b in range(batches)
        ]
    finally:
        del iterator


class Numbers(Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return i


@pytest.mark.parametrize("in_order", [True, False])
def test_workers_waiting_for_the_loop_go_on_to_the_next_epoch(in_order):
    # Persistent workers with one batch each ahead: after one batch of the first epoch
    # they wait for the loop, which starts the next epoch instead; that wait must end.
    loader = DataLoader(
        Numbers(), batch_size=2, num_workers=2, prefetch_factor=1, persistent_workers=True, in_order=in_order
    )
    first = iter(loader)
    assert next(first).tolist() in ([0, 1], [2, 3])
    epoch = sorted(batch.tolist() for batch in loader)
    assert epoch == [[i, i + 1] for i in range(0, 24, 2)]
    assert sorted(batch.tolist() for batch in loader) == epoch
