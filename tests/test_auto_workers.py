"""num_workers="auto" on mprs_plus.DataLoader: the count chosen while the epoch runs, the
batches those of a fixed count (seeding="batch"), persistent workers, worker_restarts and
checkpoints working as with a fixed count.

What the policy decides on is forced (each window's figures are the test's: samples that
wait, a loop that sets the pace, memory that would not hold another worker), and what is
asserted is counted (the counts chosen, the worker processes started), never timed. Windows
are judged by their batches alone (``MIN_SECONDS`` 0), so a resize comes after a known
number of batches whatever the machine's load."""

from __future__ import annotations

import warnings

import pytest
import torch

import mprs_plus
from elastic_datasets import Augmented, rows
from mprs_plus import autoscale
from mprs_plus.autoscale import Window
from mprs_plus.dataloader import auto as auto_module
from mprs_plus.dataloader.auto import AutoWorkers

GIB = 1 << 30


@pytest.fixture
def figures(monkeypatch):
    """Force what each window measured: ``figures.set(waits=..., busy=..., cpu=...,
    memory=..., available=...)`` (fractions of the window; bytes), for every worker count."""

    class Forced:
        waits, busy, cpu, memory, available = 0.9, 1.0, 0.05, 0, None
        at: dict = {}  # worker count -> figures of its own (a loop that changes its pace)

        def set(self, **kwargs):
            for name, value in kwargs.items():
                setattr(self, name, value)

    forced = Forced()

    def close(window, workers, owner):
        seconds = 1.0
        f = {name: getattr(forced, name) for name in ("waits", "busy", "cpu", "memory", "available")}
        f.update(forced.at.get(workers, {}))
        return Window(
            workers, seconds, window.batches, f["waits"] * seconds, f["busy"] * workers * seconds,
            f["cpu"] * workers * seconds, 0.0, f["memory"], f["available"],
        )

    monkeypatch.setattr(auto_module._Open, "close", close)
    monkeypatch.setattr(autoscale, "MIN_SECONDS", 0.0)
    monkeypatch.setattr(auto_module, "FIRST_WORKERS", 1)  # the counts below grow from one, on any machine
    return forced


def epoch(loader):
    return [rows(batch) for batch in loader]


def fixed(n=48, **kwargs):
    torch.manual_seed(0)
    kwargs.setdefault("batch_size", 2)
    return epoch(mprs_plus.DataLoader(Augmented(n), num_workers=2, seeding="batch", **kwargs))


def test_waiting_samples_grow_the_workers_past_the_cores_and_the_batches_stay_a_fixed_counts(figures):
    figures.set(waits=0.9, busy=1.0, cpu=0.05)  # busy all the time, little of it on a CPU: samples that wait
    torch.manual_seed(0)
    loader = mprs_plus.DataLoader(Augmented(48), batch_size=2, num_workers="auto", max_workers=6)
    got = epoch(loader)
    assert got == fixed()
    auto = loader._keep.auto
    assert auto.policy.history == [1, 6]
    assert len(auto.started) == 7  # one worker, then six new ones: more than this machine's cores
    summary = loader.stats().summary()
    assert "num_workers='auto': 6 workers (1 -> 6)" in summary and "their samples wait" in summary
    assert "held at max_workers=6" in summary
    assert "num_workers='auto': 6 workers (1 -> 6)" in loader.explain()


def test_the_loop_that_sets_the_pace_keeps_one_worker(figures):
    figures.set(waits=0.01, busy=0.6, cpu=0.6)
    torch.manual_seed(0)
    loader = mprs_plus.DataLoader(Augmented(48), batch_size=2, num_workers="auto")
    assert epoch(loader) == fixed()
    assert loader._keep.auto.policy.history == [1] and len(loader._keep.auto.started) == 1
    assert "stays at 1: the loop sets the pace" in loader.stats().workers_chosen


def test_workers_mostly_idle_behind_a_loop_that_sets_the_pace_are_retired(figures):
    figures.set(waits=0.9, busy=1.0, cpu=0.05, at={4: {"waits": 0.01, "busy": 0.2, "cpu": 0.2}})
    torch.manual_seed(0)
    loader = mprs_plus.DataLoader(Augmented(64), batch_size=2, num_workers="auto", max_workers=4)
    assert epoch(loader) == fixed(n=64)
    auto = loader._keep.auto
    # At one worker the loop waits again: growth goes back, but below the count retired.
    assert auto.policy.history == [1, 4, 1, 3]
    assert len(auto.started) == 9  # 1, then 4, then 1, then 3
    assert "4 -> 1: the loop sets the pace" in auto.policy.decisions[2].reason
    assert "held below 4" in loader.stats().workers_chosen


def test_memory_refuses_a_worker_it_cannot_hold(figures):
    figures.set(waits=0.9, busy=1.0, cpu=0.05, memory=2 * GIB, available=GIB)
    torch.manual_seed(0)
    loader = mprs_plus.DataLoader(Augmented(48), batch_size=2, num_workers="auto")
    assert epoch(loader) == fixed()
    auto = loader._keep.auto
    assert auto.policy.history == [1] and len(auto.started) == 1
    assert auto.policy.decisions[-1].limit == "memory"
    assert "held by memory" in loader.stats().summary()


class KilledUnderThree(Augmented):
    """Sample ``at`` kills its process the first time, in a worker of a run of 3 only (the
    count auto chose, never the one it started with)."""

    def __init__(self, n, at, marker):
        super().__init__(n)
        self.at, self.marker = at, marker

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        if i == self.at and info is not None and info.num_workers == 3:
            from restart_datasets import die_once

            die_once(self.marker)
        return super().__getitem__(i)


def test_a_worker_killed_under_auto_is_replaced_and_the_batches_are_the_uninterrupted_runs(tmp_path, figures):
    figures.set(waits=0.9, busy=1.0, cpu=0.05)
    expected = fixed(n=64)
    torch.manual_seed(0)
    dataset = KilledUnderThree(64, at=50, marker=str(tmp_path / "killed"))
    loader = mprs_plus.DataLoader(dataset, batch_size=2, num_workers="auto", max_workers=3, worker_restarts=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = epoch(loader)
    assert (tmp_path / "killed").exists()  # the death happened, under the count auto chose
    assert got == expected
    assert loader._keep.auto.policy.history == [1, 3]
    made = loader.stats().replacements
    assert len(made) == 1 and made[0].cause == "SIGKILL"


def test_persistent_workers_keep_the_count_chosen_into_the_next_epoch(figures):
    figures.set(waits=0.9, busy=1.0, cpu=0.05)
    torch.manual_seed(0)
    loader = mprs_plus.DataLoader(Augmented(48), batch_size=2, num_workers="auto", max_workers=3, persistent_workers=True)
    first = epoch(loader)
    started = list(loader._keep.auto.started)
    figures.set(waits=0.01, busy=0.9, cpu=0.9)  # the second epoch's loop sets the pace: no change
    second = epoch(loader)
    torch.manual_seed(0)
    reference = mprs_plus.DataLoader(Augmented(48), batch_size=2, num_workers=3, seeding="batch", persistent_workers=True)
    assert [first, second] == [epoch(reference), epoch(reference)]
    assert len(started) == 4 and loader._keep.auto.started == started  # the 3 workers served epoch 2
    assert loader._run.runtime.plan.num_workers == 3


def test_a_state_taken_after_a_resize_restores_exactly_with_auto_and_with_a_fixed_count(figures):
    figures.set(waits=0.9, busy=1.0, cpu=0.05)
    expected = fixed(n=60)
    torch.manual_seed(0)
    loader = mprs_plus.DataLoader(Augmented(60), batch_size=2, num_workers="auto", max_workers=4)
    iterator = iter(loader)
    head = [rows(next(iterator)) for _ in range(20)]  # past the first window: four workers now
    assert loader._keep.auto.count == 4
    state = loader.state_dict()
    del iterator
    assert head == expected[:20]
    for count in ("auto", 3, 0):
        restored = mprs_plus.DataLoader(
            Augmented(60), batch_size=2, num_workers=count, seeding="batch",
            **({"max_workers": 4} if count == "auto" else {}),
        )
        restored.load_state_dict(state)
        assert epoch(restored) == expected[20:], count


def test_auto_refuses_what_cannot_change_its_count_inside_an_epoch():
    from elastic_datasets import Indices
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    with pytest.raises(ValueError, match="num_workers='auto' needs a map-style dataset"):
        mprs_plus.DataLoader(Stream(), num_workers="auto")
    with pytest.raises(ValueError, match="num_workers must be an int >= 0 or 'auto'"):
        mprs_plus.DataLoader(Indices(4), num_workers="many")
    with pytest.raises(ValueError, match="max_workers caps num_workers='auto'"):
        mprs_plus.DataLoader(Indices(4), num_workers=2, max_workers=4)
    with pytest.raises(ValueError, match="max_workers must be an int >= 1"):
        mprs_plus.DataLoader(Indices(4), num_workers="auto", max_workers=0)
    with pytest.raises(ValueError, match="num_workers='auto' is mprs_plus.DataLoader's"):
        mprs_plus.MultiProcessingReadingService(num_workers="auto")


def test_auto_implies_batch_seeding_unless_seeding_is_given():
    from elastic_datasets import Indices

    assert mprs_plus.DataLoader(Indices(4), num_workers="auto").seeding == "batch"
    assert mprs_plus.DataLoader(Indices(4), num_workers="auto", seeding="worker").seeding == "worker"
    loader = mprs_plus.DataLoader(Indices(4), num_workers="auto", max_workers=5)
    # The attribute says "auto", and compares as its cap with a count (a trainer's warnings).
    assert loader.num_workers == "auto" and str(loader.num_workers) == "auto" and loader.num_workers > 2
    again = mprs_plus.DataLoader(Indices(4), num_workers=loader.num_workers)  # re-created from its attributes
    assert again.num_workers == "auto" and again._keep.auto.policy.max_workers == 5


def test_the_policy_is_judged_on_windows_that_begin_after_a_runs_first_batch():
    """No process: the first batch of a run opens the window, the next ones fill it."""

    class Run:
        class runtime:
            @staticmethod
            def stats():
                raise RuntimeError("no statistics")

            @staticmethod
            def worker_processes():
                return []

    auto = AutoWorkers(max_workers=4)
    auto.begin()
    auto.waited(5.0, Run)  # the start of the workers: not judged
    assert auto._window is not None and auto._window.wait == 0.0 and auto._window.batches == 0
    for _ in range(3):
        auto.waited(0.1, Run)
    assert auto._window.batches == 3 and auto._window.wait == pytest.approx(0.3)


def test_more_workers_that_would_not_win_their_start_back_are_the_next_epochs(figures, monkeypatch):
    """Forced: no start pays. The epoch ends on the worker it began with, and the next one
    begins with the count decided, the batches a fixed count's throughout."""
    figures.set(waits=0.9, busy=1.0, cpu=0.05)
    monkeypatch.setattr(autoscale, "start_pays", lambda *args: False)
    torch.manual_seed(0)
    loader = mprs_plus.DataLoader(Augmented(48), batch_size=2, num_workers="auto", max_workers=3)
    first = epoch(loader)
    auto = loader._keep.auto
    assert len(auto.started) == 1 and auto.count == 3 and auto.resizes == 0
    assert "from the next epoch on: the" in loader.stats().workers_chosen
    second = epoch(loader)
    assert len(auto.started) == 4  # the second epoch's three
    torch.manual_seed(0)
    reference = mprs_plus.DataLoader(Augmented(48), batch_size=2, num_workers=2, seeding="batch")
    assert [first, second] == [epoch(reference), epoch(reference)]


def test_auto_starts_two_workers_or_as_many_as_the_cores():
    for cores, first in ((1, 1), (2, 2), (64, 2)):
        policy = autoscale.AutoPolicy(8, cores, start=min(auto_module.FIRST_WORKERS, cores))
        assert AutoWorkers(policy=policy).count == first
    cores = autoscale.usable_cores()
    assert AutoWorkers().count == min(2, cores)
    assert AutoWorkers(max_workers=1).count == 1
    assert "started with" in AutoWorkers().policy.decisions[0].reason

