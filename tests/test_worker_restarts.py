"""worker_restarts=N: a dead worker is replaced, and the loop gets the uninterrupted run's
batches (in order with in_order=True, the same set with in_order=False), compared with the
run nobody killed and with torch's DataLoader for the same seed.

Every death is forced: the dataset (or worker_init_fn) kills its own process with SIGKILL
at a chosen index, the first time only (a marker file in tmp_path), or every time for a
poison sample. The start-method matrix runs the first case; the others run under the
default start method."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import warnings
from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader

import mprs_plus
from restart_datasets import (
    ChainedKills,
    ChainedKillsMap,
    CountsReads,
    CountsWithState,
    DiesInInit,
    Draws,
    DrawsIterable,
    KillAt,
    LargeState,
    LogsReads,
    Reads,
    collate_with_a_draw,
    killed_in_epoch_two,
    read_through,
)

THIS_FILE = os.path.abspath(__file__)


def batches(loader_class, dataset, epochs=1, **kwargs):
    """Each epoch's batches as lists, the global seed set as a training script sets it."""
    kwargs.setdefault("batch_size", 4)
    kwargs.setdefault("num_workers", 2)
    torch.manual_seed(0)
    loader = loader_class(dataset, **kwargs)
    return [[_plain(batch) for batch in loader] for _ in range(epochs)]


def _plain(batch):
    if isinstance(batch, (list, tuple)):
        return [_plain(part) for part in batch]
    return batch.tolist()


def replaced(caught):
    return [w for w in caught if issubclass(w.category, RuntimeWarning) and "A new worker replaces it" in str(w.message)]


def test_a_worker_killed_at_a_chosen_sample_is_replaced_and_the_batches_are_torchs(tmp_path, start_method):
    expected = batches(TorchDataLoader, Draws())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = batches(
            mprs_plus.DataLoader,
            Draws(kill_at=29, marker=str(tmp_path / "killed")),
            worker_restarts=1,
            multiprocessing_context=start_method,
        )
    assert got == expected
    assert (tmp_path / "killed").exists()  # the death happened
    said = replaced(caught)
    assert len(said) == 1
    message = str(said[0].message)
    assert "worker 1 (pid " in message and "was killed by SIGKILL" in message  # batch 7 is worker 1's
    assert "last resident memory" in message and "replacement 1 of worker_restarts=1" in message
    assert os.path.abspath(said[0].filename) == THIS_FILE  # the user's line


def test_a_collate_function_that_draws_gets_torchs_draws_after_a_replacement(tmp_path):
    """The replacement makes again the batches received since the record it starts from:
    a collate function of the user's runs for them too, so its draws (random masking) are
    made again and the batches after them are torch's."""
    expected = batches(TorchDataLoader, Draws(), collate_fn=collate_with_a_draw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = batches(
            mprs_plus.DataLoader,
            Draws(kill_at=37, marker=str(tmp_path / "killed")),
            collate_fn=collate_with_a_draw,
            worker_restarts=1,
        )
    assert (tmp_path / "killed").exists()
    assert got == expected


def test_a_replacement_replays_from_the_latest_record_not_from_the_epoch_start(tmp_path, monkeypatch):
    """The worker records its generators as it goes (here after every batch: under fork the
    children see the setting); its replacement starts at the latest record at or before
    what the loop received, so worker 1's first batch (indices 4-7) is never read again."""
    import mprs_plus.runtime.generators as generators

    monkeypatch.setattr(generators, "RECORD_SECONDS", 0.0)
    # Index 1205 is in batch 301, worker 1's 151st: far past what a worker may have made and
    # not sent when it dies (2 ms of work, child/batching.py), so a record the loop has passed exists.
    expected = batches(TorchDataLoader, Draws(n=1300))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = batches(
            mprs_plus.DataLoader,
            LogsReads(str(tmp_path), n=1300, kill_at=1205, marker=str(tmp_path / "killed")),
            worker_restarts=1,
            multiprocessing_context="fork",
        )
    assert (tmp_path / "killed").exists()
    assert got == expected
    reads = [int(line) for log in tmp_path.glob("reads-*") for line in log.read_text().split()]
    assert reads.count(4) == 1
    assert reads.count(1205) == 2  # the sample that killed the worker is read again, by its replacement


def test_a_map_style_dataset_with_state_is_replaced_from_its_recorded_state(tmp_path, monkeypatch):
    """Each sample says how many its replica had read: the dataset's state, recorded with
    the generators (here every 10 ms), which the replacement loads before it reads again
    only the samples after the record."""
    import mprs_plus.runtime.generators as generators

    monkeypatch.setattr(generators, "RECORD_SECONDS", 0.01)
    n, kill_at = 4000, 3205  # batch 801, worker 1's 401st of 500
    expected = batches(TorchDataLoader, Reads(n=n))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = batches(
            mprs_plus.DataLoader,
            CountsReads(str(tmp_path), n=n, kill_at=kill_at, marker=str(tmp_path / "killed")),
            worker_restarts=1,
            multiprocessing_context="fork",
        )
    assert (tmp_path / "killed").exists()
    assert got == expected
    reads = Counter(int(line) for log in tmp_path.glob("reads-*") for line in log.read_text().split())
    assert reads[4] == 1  # worker 1's first sample was read once: its epoch was not read again
    assert reads[kill_at] == 2


def test_an_iterable_dataset_with_state_is_replaced_from_its_recorded_state_not_from_its_epochs_start(
    tmp_path, monkeypatch
):
    """An iterable dataset with state_dict() has its state recorded with the generators (here
    every 10 ms: under fork the children see the setting); the replacement loads the latest
    record the loop has passed and makes only the elements after it, not worker 1's share
    of the epoch again, and the loop gets the uninterrupted run's batches."""
    import mprs_plus.runtime.generators as generators

    monkeypatch.setattr(generators, "RECORD_SECONDS", 0.01)
    n, kill_at = 8000, 6401  # worker 1's element 3200 of 4000
    expected = batches(TorchDataLoader, CountsWithState(n))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = batches(
            mprs_plus.DataLoader,
            CountsWithState(n, str(tmp_path), kill_at, str(tmp_path / "killed")),
            worker_restarts=1,
            multiprocessing_context="fork",
        )
    assert (tmp_path / "killed").exists()
    assert got == expected
    made = Counter(int(line) for log in tmp_path.glob("made-*") for line in log.read_text().split())
    assert sorted(made) == list(range(n))
    assert made[1] == 1  # worker 1's first element was made once: its epoch was not made again
    assert made[kill_at] == 2  # the element that killed the worker, made again by its replacement
    again = sum(count - 1 for count in made.values())
    assert 0 < again < 3200  # fewer than the elements worker 1 had made when it died


def test_a_dataset_state_too_large_for_a_record_is_replayed_from_the_epochs_start(tmp_path, monkeypatch):
    """A state that does not fit its record is not recorded (here each batch tries): the
    replacement makes the worker's epoch again from its start, and the batches are the same."""
    import mprs_plus.runtime.generators as generators

    monkeypatch.setattr(generators, "RECORD_SECONDS", 0.0)
    expected = batches(TorchDataLoader, CountsWithState(400))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = batches(
            mprs_plus.DataLoader,
            LargeState(400, str(tmp_path), 301, str(tmp_path / "killed")),
            worker_restarts=1,
            multiprocessing_context="fork",
        )
    assert (tmp_path / "killed").exists()
    assert got == expected
    made = Counter(int(line) for log in tmp_path.glob("made-*") for line in log.read_text().split())
    assert made[1] == 2  # worker 1's epoch was made again from its start


def test_without_worker_restarts_a_killed_worker_is_still_the_error(tmp_path):
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid \d+\) is killed by signal: Killed"):
        batches(mprs_plus.DataLoader, Draws(kill_at=29, marker=str(tmp_path / "killed")))


def test_in_order_false_gives_the_same_set(tmp_path):
    expected = batches(TorchDataLoader, Draws())[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = batches(
            mprs_plus.DataLoader, Draws(kill_at=21, marker=str(tmp_path / "killed")), worker_restarts=1, in_order=False
        )[0]
    assert sorted(map(str, got)) == sorted(map(str, expected))


def test_an_iterable_dataset_worker_is_replaced(tmp_path):
    expected = batches(TorchDataLoader, DrawsIterable())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = batches(mprs_plus.DataLoader, DrawsIterable(kill_at=27, marker=str(tmp_path / "killed")), worker_restarts=1)
    assert got == expected


def test_persistent_workers_killed_in_a_later_epoch_draw_what_the_dead_one_would_have(tmp_path):
    """The replacement loads the generator states the dead worker had when epoch 2 began:
    persistent workers carry their generators across epochs, as torch's do."""
    marker, armed = str(tmp_path / "killed"), tmp_path / "armed"
    expected = batches(TorchDataLoader, Draws(), epochs=3, persistent_workers=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, loader = killed_in_epoch_two(marker, armed, _plain)
        stats = loader.stats()
        explained = loader.explain()
        del loader
    assert os.path.exists(marker)
    assert got == expected
    assert len(replaced(caught)) == 1
    assert [made.epoch for made in stats.replacements] == [2]
    assert stats.replacement_causes == {"SIGKILL": 1}
    assert "dead workers replaced: 1 (SIGKILL x1)" in stats.summary()
    assert "replaced so far: 1 (SIGKILL x1)" in explained


def test_a_worker_killed_in_worker_init_fn_is_replaced(tmp_path):
    expected = batches(TorchDataLoader, Draws(), worker_init_fn=DiesInInit(1, None))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = batches(
            mprs_plus.DataLoader, Draws(), worker_init_fn=DiesInInit(1, str(tmp_path / "killed")), worker_restarts=1
        )
    assert (tmp_path / "killed").exists()
    assert got == expected
    assert len(replaced(caught)) == 1


def test_large_batches_lent_by_the_dead_worker_stay_valid(tmp_path):
    """Batches of 256 KiB tensors are lent as views of the worker's shared memory; the
    loop holds worker 1's first ones while worker 1 dies, and they keep their values."""
    size = 8 << 10  # float64 samples, 4 per batch: 256 KiB tensors
    dataset = Draws(kill_at=37, marker=str(tmp_path / "killed"), size=size)
    expected = batches(TorchDataLoader, Draws(size=size))[0]
    torch.manual_seed(0)
    loader = mprs_plus.DataLoader(dataset, batch_size=4, num_workers=2, worker_restarts=1)
    held, got = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for number, (large, drawn) in enumerate(loader):
            if number in (1, 3):  # worker 1's first two batches, made before it died
                held.append((number, large))
            got.append([large.tolist(), drawn.tolist()])
    assert (tmp_path / "killed").exists()
    assert got == expected
    stats = loader.stats()
    assert stats.large_buffers.lent > 0  # the batches were lent, not copied
    for number, large in held:
        assert large.tolist() == expected[number][0]


def poison_run(**kwargs):
    """Index 29 (batch 7, worker 1's fourth) kills every worker that reads it: the loop's
    batches, None where next() raised, the errors, the replacements and their warnings."""
    torch.manual_seed(0)
    loader = mprs_plus.DataLoader(Draws(kill_at=29, poison=True), batch_size=4, num_workers=2, worker_restarts=2,
                                  **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, errors = read_through(loader, _plain)
    return got, [str(error) for error in errors], loader.stats().replacements, replaced(caught)


def check_poison_run(got, errors, made, said):
    """Two deaths, the poison batch raised in torch's words in its place, the others the run's."""
    expected = batches(TorchDataLoader, Draws())[0]
    assert len(errors) == 1
    assert "DataLoader worker (pid " in errors[0] and "is killed by signal: Killed" in errors[0]
    assert "indices [28, 29, 30, 31]" in errors[0]
    assert got.index(None) == 7  # batch 7 holds index 29; the next next() went on with batch 8
    assert len(got) == len(expected)
    # Those before the poison batch are the uninterrupted run's batches exactly; those after
    # it have its indices (the draws the poison batch made are lost with it).
    assert got[:7] == expected[:7]
    assert [[row[0] for row in b] for b in got[8:]] == [[row[0] for row in b] for b in expected[8:]]
    assert [m.poison for m in made] == [False, True]  # exactly two deaths, within worker_restarts=2
    assert [m.worker for m in made] == [1, 1]
    assert len(said) == 2


def test_a_poison_sample_is_that_batchs_error_after_two_deaths_and_the_epoch_goes_on():
    got, errors, made, said = poison_run()
    check_poison_run(got, errors, made, said)


def test_a_poison_sample_costs_two_deaths_when_the_dead_worker_held_batches_it_never_sent(monkeypatch):
    """The workers' batching clock is stopped (forked workers inherit it): a small batch
    leaves a worker only when the worker flushes, so worker 1 has made its batches 3 and 5
    and sent neither when batch 7 kills it. Its death already says which batch it was
    making; the replacement makes 3 and 5 again, hands them on one by one, and dies
    making 7: that is the poison batch, at the second death, not the third."""
    from mprs_plus.runtime.child import batching

    monkeypatch.setattr(batching, "_clock", lambda: 0.0)
    got, errors, made, said = poison_run(multiprocessing_context="fork")
    assert made[0].items < 3  # the first death had made batches that never reached the main process
    check_poison_run(got, errors, made, said)


def test_a_spent_budget_is_the_error_and_says_how_many_were_replaced(tmp_path):
    dataset = ChainedKills([(9, str(tmp_path / "first")), (30, str(tmp_path / "second"))])
    loader = mprs_plus.DataLoader(dataset, batch_size=4, num_workers=2, worker_restarts=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(RuntimeError, match=r"is killed by signal: Killed.*1 dead worker\(s\) were replaced before"):
            list(loader)
    assert (tmp_path / "second").exists()


def test_the_reading_service_replaces_a_dead_worker(tmp_path):
    from torchdata.dataloader2 import DataLoader2
    from torchdata.datapipes.iter import IterableWrapper

    def pipeline(marker):
        return IterableWrapper(range(40)).shuffle().sharding_filter().map(KillAt(23, marker))

    def run(marker, restarts):
        service = mprs_plus.MultiProcessingReadingService(num_workers=2, worker_restarts=restarts)
        loader = DataLoader2(pipeline(marker), reading_service=service)
        loader.seed(7)
        try:
            return list(loader), service.stats()
        finally:
            loader.shutdown()

    expected, _ = run(None, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, stats = run(str(tmp_path / "killed"), 1)
    assert (tmp_path / "killed").exists()
    assert got == expected
    assert len(replaced(caught)) == 1
    assert len(stats.replacements) == 1


def test_worker_restarts_takes_a_count_of_replacements_with_either_backend():
    from mprs_plus.options import Options

    assert Options(num_workers=2, worker_restarts=1, backend=mprs_plus.RayBackend()).worker_restarts == 1
    with pytest.raises(ValueError, match="worker_restarts must be"):
        Options(num_workers=2, worker_restarts=-1)


def test_a_checkpoint_taken_after_a_replacement_restores_the_rest_of_the_epoch(tmp_path):
    expected = batches(TorchDataLoader, Draws())[0]
    torch.manual_seed(0)
    loader = mprs_plus.DataLoader(Draws(kill_at=13, marker=str(tmp_path / "killed")), batch_size=4, num_workers=2,
                                  worker_restarts=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        iterator = iter(loader)
        head = [_plain(next(iterator)) for _ in range(6)]
        state = loader.state_dict()
    del iterator
    assert (tmp_path / "killed").exists()
    fresh = mprs_plus.DataLoader(Draws(), batch_size=4, num_workers=2)
    fresh.load_state_dict(state)
    assert head + [_plain(batch) for batch in fresh] == expected
    del loader


def test_a_worker_killed_after_a_checkpoint_restore_is_replaced_after_what_the_restore_skipped(tmp_path):
    """A restored epoch's workers skip the batches the checkpoint's loop had; a replacement
    in that epoch skips them too, and those the loop received since."""
    expected = batches(TorchDataLoader, Draws())[0]
    torch.manual_seed(0)
    loader = mprs_plus.DataLoader(Draws(), batch_size=4, num_workers=2)
    iterator = iter(loader)
    head = [_plain(next(iterator)) for _ in range(4)]
    state = loader.state_dict()
    del iterator, loader
    restored = mprs_plus.DataLoader(Draws(kill_at=37, marker=str(tmp_path / "killed")), batch_size=4, num_workers=2,
                                    worker_restarts=1)
    restored.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        rest = [_plain(batch) for batch in restored]
    assert (tmp_path / "killed").exists()
    assert head + rest == expected
    assert len(restored.stats().replacements) == 1


def test_the_poison_rule_follows_the_item_each_worker_died_making():
    """The rule alone (no process): a death names the item the worker was making; a
    replacement that dies making the same one, with every item before it received, makes
    it a poison item (its error takes that item's place). A death before the stream began
    (None) names no item, and one with items before it missing is replaced again."""
    from mprs_plus.runtime.main.replacement import Replacements

    def unused():
        return RuntimeError("unused")

    replacements = Replacements(budget=5, skips_lost=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        first = replacements.on_death(1, 100, -9, 1, (1,), unused, (3,))  # items 1 and 2 made, never sent
        in_init = replacements.on_death(1, 101, -9, 1, (1,), unused, (None,))  # died before its stream began
        missing = replacements.on_death(1, 102, -9, 1, (2,), unused, (3,))  # item 2 never reached the main process
        poison = replacements.on_death(1, 103, -9, 1, (3,), unused, (3,))
        elsewhere = replacements.on_death(0, 104, -9, 1, (3,), unused, (3,))  # another worker: its first death
    assert [m.poison for m in (first, in_init, missing, poison, elsewhere)] == [False, False, False, True, False]
    assert poison.items == 3


def test_a_sigkill_near_the_memory_limit_is_said_to_be_likely_the_out_of_memory_killer():
    """The warning's words, from the memory watch's last sample (no process needed)."""
    from mprs_plus.runtime.main.replacement import Replacements

    replacements = Replacements(budget=2, skips_lost=True)
    replacements.memory.rss[4242] = 3 << 30
    replacements.memory.near_limit = True
    with pytest.warns(RuntimeWarning) as caught:
        made = replacements.on_death(1, 4242, -9, 1, (5,), lambda: RuntimeError("unused"))
    message = str(caught[0].message)
    assert "worker 1 (pid 4242) was killed by SIGKILL; likely the out-of-memory killer" in message
    assert "last resident memory 3072 MiB" in message
    assert made.out_of_memory and made.cause == "SIGKILL" and made.items == 5
    replacements.memory.near_limit = False
    with pytest.warns(RuntimeWarning) as caught:
        made = replacements.on_death(0, 4243, 3, 1, (2,), lambda: RuntimeError("unused"))
    assert "out-of-memory" not in str(caught[0].message) and "ended (exit code 3)" in str(caught[0].message)
    assert not made.out_of_memory


def test_the_budget_is_the_loaders_across_epochs_without_persistent_workers(tmp_path):
    """Each epoch starts new workers; the replacements of earlier epochs still count."""
    dataset = ChainedKills([(9, str(tmp_path / "first"))])
    loader = mprs_plus.DataLoader(dataset, batch_size=4, num_workers=2, worker_restarts=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert [int(x) for batch in loader for x in batch] == list(range(48))
        dataset.kills = {30: str(tmp_path / "second")}  # new workers copy the dataset as it is now
        with pytest.raises(RuntimeError, match=r"1 dead worker\(s\) were replaced before"):
            list(loader)
    # stats() and explain() count what the budget counts: the loader's life, not the last epoch's.
    assert [made.cause for made in loader.stats().replacements] == ["SIGKILL"]
    assert "replaced so far: 1 (SIGKILL x1)" in loader.explain()


def test_a_replacement_leaves_no_descriptor_or_mapping_behind(tmp_path):
    """The dead worker's channels and process handle are let go of at once: after an epoch
    with a replacement, the running loader holds what one nobody killed holds."""
    from test_release import snapshot

    def held(marker):
        loader = mprs_plus.DataLoader(
            Draws(kill_at=37, marker=marker, size=8 << 10), batch_size=4, num_workers=2, worker_restarts=1,
            persistent_workers=True,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for _ in loader:
                pass
        holding = snapshot()  # the workers still run
        del loader
        return holding

    assert held(str(tmp_path / "killed")) == held(None)
    assert (tmp_path / "killed").exists()


def test_a_poison_item_of_a_datapipe_pipeline_is_the_error_it_cannot_be_left_out():
    """A DataPipe stream cannot leave an item out: the second death at the same item is
    the death's error, saying so, within the budget."""
    from torchdata.dataloader2 import DataLoader2
    from torchdata.datapipes.iter import IterableWrapper

    from restart_datasets import KillsEvery

    service = mprs_plus.MultiProcessingReadingService(num_workers=2, worker_restarts=5)
    loader = DataLoader2(IterableWrapper(range(40)).sharding_filter().map(KillsEvery(23)), reading_service=service)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            with pytest.raises(mprs_plus.ProcessDiedError, match="cannot leave an item out"):
                list(loader)
        assert len(service.stats().replacements) < 5
    finally:
        loader.shutdown()


def test_a_replacements_channels_are_laid_out_as_the_dead_workers(tmp_path, monkeypatch):
    """A loader that pins opens its channels inside ``pinning_receivers()`` (its feeding's
    ``channels()``), so that their lend areas are cut into page-lock chunks; a replacement's
    channels, opened later from the loop, must be cut the same way, or its tensors would
    straddle registrations."""
    from mprs_plus.transport import _lend, pipe, shm

    layouts: list[int] = []

    def recorded(region):
        _lend.lay_out_area(region)
        layouts.append(int(region.ctl[_lend.LOCK_CHUNKED]))

    for module in (shm, pipe):
        monkeypatch.setattr(module, "lay_out_area", recorded)
    expected = batches(TorchDataLoader, Draws())[0]
    torch.manual_seed(0)
    dataset = Draws(kill_at=29, marker=str(tmp_path / "killed"))
    loader = mprs_plus.DataLoader(dataset, batch_size=4, num_workers=2, worker_restarts=1)
    with _lend.pinning_receivers():  # as a pinning loader opens them
        iterator = iter(loader)
    first = len(layouts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = [_plain(batch) for batch in iterator]
    assert (tmp_path / "killed").exists() and got == expected
    assert first > 0 and len(layouts) > first  # the replacement opened channels of its own
    assert set(layouts) == {1}


def dispatched(n, worker_map, notes=None, epochs=1, **options):
    """Each epoch's items of a DataPipe pipeline whose items a dispatch process deals
    (``sharding_round_robin_dispatch``), ``worker_map`` applied in the workers; and the
    service's replacements."""
    from torchdata.dataloader2 import DataLoader2
    from torchdata.datapipes.iter import IterableWrapper
    from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES

    from restart_datasets import NotesDealt

    pipe = IterableWrapper(range(n)).map(NotesDealt(notes))
    pipe = pipe.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING).map(worker_map)
    options.setdefault("num_workers", 2)
    service = mprs_plus.MultiProcessingReadingService(**options)
    loader = DataLoader2(pipe, reading_service=service)
    loader.seed(7)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = [list(loader) for _ in range(epochs)]
        return got, service.stats().replacements, replaced(caught)
    finally:
        loader.shutdown()


@pytest.mark.parametrize(
    "start_method, in_order", [("fork", True), ("fork", False), ("spawn", True), ("forkserver", True)]
)
def test_a_worker_fed_by_a_dispatch_process_is_replaced_and_dealt_its_epoch_again(tmp_path, start_method, in_order):
    """Worker 1 dies at item 97 with items dealt to it and not made into outputs; the
    dispatch process deals its replacement the epoch again, which replays it (drawing
    what the dead one drew) and goes on: the uninterrupted run's items, in order with
    in_order=True, the same set with in_order=False. Under spawn and forkserver too: the
    new channels' ends reach the running dispatch process whatever started it."""
    options = {"in_order": in_order, "multiprocessing_context": start_method}
    (expected,), _, _ = dispatched(160, KillAt(-1, None), **options)
    (got,), made, said = dispatched(160, KillAt(97, str(tmp_path / "killed")), worker_restarts=1, **options)
    assert (tmp_path / "killed").exists()  # the death happened
    assert [(m.worker, m.cause) for m in made] == [(1, "SIGKILL")] and len(said) == 1
    if in_order:
        assert got == expected
    else:
        assert sorted(got) == sorted(expected) and len(got) == 160


@pytest.mark.parametrize("in_order", [True, False])
def test_a_worker_killed_while_the_dispatcher_waits_on_its_full_channel(tmp_path, in_order):
    """Each dispatch channel holds one item, one per message. Worker 1 stops at item 151
    until the dispatch process has made item 155: 153 then fills worker 1's channel, so
    the dispatcher is sending 155 to it, a send that cannot end while worker 1 lives. Then
    worker 1 dies: the broken channel frees the dispatcher, which goes on dealing to
    worker 0 and deals the replacement its epoch again."""
    from restart_datasets import KillOnceDealt

    marker, notes = str(tmp_path / "killed"), str(tmp_path / "dealt")
    (expected,), _, _ = dispatched(200, KillAt(-1, None), in_order=in_order, dispatch_buffer_size=1)
    (got,), made, _ = dispatched(
        200, KillOnceDealt(151, marker, notes, 155), notes, worker_restarts=1, in_order=in_order, dispatch_buffer_size=1
    )
    assert os.path.exists(marker + ".saw")  # the dispatcher had made item 155 before the kill
    assert [(m.worker, m.cause) for m in made] == [(1, "SIGKILL")]
    if in_order:
        assert got == expected
    else:
        assert sorted(got) == sorted(expected) and len(got) == 200


def test_a_dispatch_fed_worker_killed_in_a_later_epoch_of_persistent_workers(tmp_path):
    """The dispatch process's log holds one epoch: a death in the second epoch is dealt
    that epoch again, and the first epoch's items are not."""
    from restart_datasets import KillsInEpoch

    expected, _, _ = dispatched(60, KillAt(-1, None), epochs=3)
    notes = str(tmp_path / "dealt")
    killer = KillsInEpoch(41, str(tmp_path / "killed"), notes + ".epochs")
    got, made, _ = dispatched(60, killer, notes, epochs=3, worker_restarts=1)
    assert got == expected
    assert [(m.worker, m.epoch) for m in made] == [(1, 2)]


def test_a_dispatch_fed_worker_dead_twice_uses_the_budget_then_is_the_error(tmp_path):
    """A replacement that dies too is replaced in turn (dealt the epoch once more); once the
    budget is spent, the next death is the error it is without the option."""
    kills = ChainedKillsMap({31: str(tmp_path / "first"), 71: str(tmp_path / "second")})
    (expected,), _, _ = dispatched(100, ChainedKillsMap({}))
    (got,), made, _ = dispatched(100, kills, worker_restarts=2)
    assert got == expected and [m.worker for m in made] == [1, 1]
    kills = ChainedKillsMap({31: str(tmp_path / "third"), 71: str(tmp_path / "fourth")})
    with pytest.raises(RuntimeError, match=r"1 dead worker\(s\) were replaced before"):
        dispatched(100, kills, worker_restarts=1)


def test_a_dispatch_process_that_dies_is_still_the_error(tmp_path):
    """Only workers are replaced: the dispatch process's death ends the epoch as without
    the option."""
    from torchdata.dataloader2 import DataLoader2
    from torchdata.datapipes.iter import IterableWrapper
    from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES

    pipe = IterableWrapper(range(100)).map(KillAt(40, str(tmp_path / "killed")))
    pipe = pipe.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING).map(abs)
    service = mprs_plus.MultiProcessingReadingService(num_workers=2, worker_restarts=3)
    loader = DataLoader2(pipe, reading_service=service)
    try:
        with pytest.raises(RuntimeError, match="dispatch"):
            list(loader)
        assert not service.stats().replacements
    finally:
        loader.shutdown()


def test_a_dispatch_fed_replacement_leaves_no_descriptor_or_mapping_behind(tmp_path):
    """The dead worker's channels, in this process and in the dispatch process, are let go
    of: while it runs and once shut down, a service that replaced a worker holds what one
    nobody killed holds. The first replacement of the process starts multiprocessing's
    resource sharer (one socket for the process's life, docs/worker-restarts.md): a first
    run takes it out of the comparison."""
    from torchdata.dataloader2 import DataLoader2
    from torchdata.datapipes.iter import IterableWrapper
    from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES

    import psutil
    from test_release import snapshot

    def held(marker):
        pipe = IterableWrapper(range(100)).sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
        service = mprs_plus.MultiProcessingReadingService(num_workers=2, worker_restarts=1, collect_stats=True)
        loader = DataLoader2(pipe.map(KillAt(61, marker)), reading_service=service)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            list(loader)
        running = snapshot()
        (dispatch,) = [p.pid for p in service.stats().processes if p.role == "dispatch"]
        dispatch_fds = psutil.Process(dispatch).num_fds()
        loader.shutdown()
        return running, dispatch_fds, snapshot()

    held(str(tmp_path / "first"))
    assert held(str(tmp_path / "killed")) == held(None)
    assert (tmp_path / "killed").exists()


def test_a_dispatch_fed_worker_killed_in_a_restored_epoch_goes_on_after_the_checkpoint(tmp_path):
    from torchdata.dataloader2 import DataLoader2
    from torchdata.datapipes.iter import IterableWrapper
    from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES

    from restart_datasets import KillOnceArmed

    marker, armed = str(tmp_path / "killed"), str(tmp_path / "armed")

    def loader():
        pipe = IterableWrapper(range(120)).sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
        service = mprs_plus.MultiProcessingReadingService(num_workers=2, worker_restarts=1)
        made = DataLoader2(pipe.map(KillOnceArmed(81, marker, armed)), reading_service=service)
        made.seed(3)
        return made

    full = loader()
    expected = list(full)
    full.shutdown()
    first = loader()
    it = iter(first)
    head = [next(it) for _ in range(30)]
    state = first.state_dict()
    first.shutdown()
    open(armed, "w").close()  # the restored pipeline (the checkpoint holds it) kills at item 81
    second = loader()
    second.load_state_dict(state)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            rest = list(second)
    finally:
        second.shutdown()
    assert head + rest == expected
    assert os.path.exists(marker)


def dealt_until_killed(marker):
    """A dispatch-fed pipeline of 100 items read to its end (or its error), with a worker
    killed at item 61 the first time (``marker``) and one replacement allowed; forked, so
    that the children get what a test patched."""
    from torchdata.dataloader2 import DataLoader2
    from torchdata.datapipes.iter import IterableWrapper
    from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES

    pipe = IterableWrapper(range(100)).sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    service = mprs_plus.MultiProcessingReadingService(num_workers=2, worker_restarts=1, multiprocessing_context="fork")
    loader = DataLoader2(pipe.map(KillAt(61, marker)), reading_service=service)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            list(loader)
    finally:
        loader.shutdown()


def test_a_stop_while_a_dispatch_fed_worker_is_replaced_leaves_no_descriptor_behind(tmp_path, monkeypatch):
    """The service stops (a shutdown from another thread, its finalizer) once the
    replacement started and before the dispatch process was handed its new channels: the
    loop gets the closed service's error, and the ends that were to reach the dispatch
    process are let go of, not left with multiprocessing's resource sharer for a
    hand-over that never comes. A first replacement starts the sharer (one socket for the
    process's life): it is taken out of the comparison."""
    from mprs_plus.runtime.main.supervisor import Supervisor
    from test_release import snapshot

    dealt_until_killed(str(tmp_path / "first"))  # the sharer started, and a replacement made as usual
    sharer_done()  # the first run's hand-overs closed on the sharer's side too
    before = snapshot()
    relaunch = Supervisor.relaunch

    stoppers = []

    def relaunch_then_stop(self, *args, **kwargs):
        relaunch(self, *args, **kwargs)
        # Another thread stops the service; the loop's thread goes on once the stop began.
        began = threading.Event()
        self.at_stop(began.set)
        stoppers.append(threading.Thread(target=self.stop))
        stoppers[0].start()
        assert began.wait(60)

    monkeypatch.setattr(Supervisor, "relaunch", relaunch_then_stop)
    with pytest.raises(mprs_plus.ServiceClosedError):
        dealt_until_killed(str(tmp_path / "killed"))
    stoppers[0].join(60)
    assert (tmp_path / "killed").exists() and not stoppers[0].is_alive()
    sharer_done()
    assert snapshot() == before


def test_a_replacement_that_dies_before_its_first_message_is_replaced_in_turn(tmp_path, monkeypatch):
    """The replacement is killed the moment it exists, before the main process sent it
    its epoch: its death is one more replacement like any other, and the messages that
    could not reach it do not end the run (on the pipe transport a write to a reader that
    is gone fails at once)."""
    from mprs_plus.runtime.main.supervisor import Supervisor

    relaunch = Supervisor.relaunch
    killed = []

    def relaunch_then_kill(self, link, *args, **kwargs):
        relaunch(self, link, *args, **kwargs)
        if not killed:
            killed.append(link.process.pid)
            os.kill(link.process.pid, signal.SIGKILL)
            link.process.join(60)

    monkeypatch.setattr(Supervisor, "relaunch", relaunch_then_kill)
    expected = batches(TorchDataLoader, Draws())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = batches(mprs_plus.DataLoader, Draws(kill_at=37, marker=str(tmp_path / "killed")), worker_restarts=2)
    assert len(killed) == 1 and got == expected
    assert len(replaced(caught)) == 2  # the worker, then its replacement


def test_a_dispatch_process_dead_before_it_read_a_redeal_leaves_no_descriptor_behind(tmp_path, monkeypatch):
    """The dispatch process dies after a worker fed by it was replaced and before it read
    the message with the replacement's channels: its death is the error, and once shut
    down this process holds no copy of those channels' descriptors (multiprocessing's
    resource sharer keeps one until it is fetched: the stop takes back those never
    fetched). A first replacement starts the sharer: it is taken out of the comparison."""
    from mprs_plus.runtime.child import dispatch
    from mprs_plus.runtime.control_messages import Redeal
    from test_release import snapshot

    dealt_until_killed(str(tmp_path / "first"))
    sharer_done()  # the first run's hand-overs closed on the sharer's side too
    before = snapshot()

    def dies_at_a_redeal(*lanes_and_counter):
        def announce(message):
            if isinstance(message, Redeal):
                os.kill(os.getpid(), signal.SIGKILL)  # as it arrives, before anything of it is taken
            return False

        return announce

    monkeypatch.setattr(dispatch, "_redealer", dies_at_a_redeal)
    with pytest.raises(RuntimeError, match="dispatch"):
        dealt_until_killed(str(tmp_path / "killed"))
    assert (tmp_path / "killed").exists()
    sharer_done()
    assert snapshot() == before


def _sharer_peer() -> Any:
    """A connection to this process's resource sharer and the key of a descriptor it
    holds for the peer (a copy of stdin's), to ask for it as ``DupFd.detach`` does."""
    from multiprocessing import current_process, resource_sharer
    from multiprocessing.connection import Client

    theirs = resource_sharer.DupFd(0)
    peer = Client(resource_sharer._resource_sharer._address, authkey=current_process().authkey)
    return peer, (theirs._id[1], os.getpid())


def sharer_done() -> None:
    """Return once multiprocessing's resource sharer has finished with every peer before
    this call. A peer gets its descriptor before the sharer closes its own copy and the
    connection, so a count of descriptors taken as the peer returns may still hold them.
    The sharer serves one peer at a time: once it has closed the connection of a request
    made now, it had closed those of every earlier one."""
    from multiprocessing import reduction
    from multiprocessing.connection import wait

    peer, request = _sharer_peer()
    try:
        peer.send(request)
        os.close(reduction.recv_handle(peer))
        assert wait([peer], timeout=60), "the resource sharer kept a served connection open for 60 s"
        with pytest.raises(EOFError):
            peer.recv()
    finally:
        peer.close()


def test_sharer_done_returns_after_the_sharer_closed_what_it_served_before():
    """The window the helper above closes, forced: the sharer has handed a descriptor to a
    peer and is held inside its own close of that descriptor; ``sharer_done`` returns only
    after that close ran."""
    from multiprocessing import current_process, reduction, resource_sharer
    from multiprocessing.connection import Client

    release, closed = threading.Event(), threading.Event()
    copy = os.dup(0)
    seen_by_close = []

    def close():  # runs in the sharer's thread, after the peer got its descriptor
        assert release.wait(60)
        seen_by_close.append(helper.is_alive())
        os.close(copy)
        closed.set()

    address, key = resource_sharer._resource_sharer.register(
        lambda conn, pid: reduction.send_handle(conn, copy, pid), close
    )
    peer = Client(address, authkey=current_process().authkey)
    peer.send((key, os.getpid()))
    os.close(reduction.recv_handle(peer))  # the peer has it; the sharer is still in close()
    helper = threading.Thread(target=sharer_done)
    helper.start()
    release.set()
    helper.join(60)
    peer.close()
    assert not helper.is_alive() and closed.is_set() and seen_by_close == [True]


@contextlib.contextmanager
def sharer_kept_busy():
    """multiprocessing's resource sharer of this process, which serves one peer at a time,
    held by a peer that is connected and silent (this test's own) until the block ends;
    then the peer takes what it asked for, every take-back helper is waited for, and so is
    the sharer (``sharer_done``)."""
    from multiprocessing import reduction

    peer, request = _sharer_peer()
    try:
        yield
    finally:
        peer.send(request)
        os.close(reduction.recv_handle(peer))
        peer.close()
    for helper in [t for t in threading.enumerate() if t.name == "mprs_plus take back"]:
        helper.join(60)
    sharer_done()


def test_a_stop_never_waits_on_another_peer_of_the_resource_sharer(tmp_path, monkeypatch):
    """Taking back a Redeal's ends goes through multiprocessing's resource sharer, which
    serves one peer at a time: with another peer connected and silent, the stop still
    ends, and the ends are taken back once the sharer is free."""
    from mprs_plus.runtime.child import dispatch
    from mprs_plus.runtime.control_messages import Redeal
    from test_release import snapshot

    dealt_until_killed(str(tmp_path / "first"))  # the sharer started
    sharer_done()  # the first run's hand-overs closed on the sharer's side too
    before = snapshot()

    def dies_at_a_redeal(*lanes_and_counter):
        def announce(message):
            if isinstance(message, Redeal):
                os.kill(os.getpid(), signal.SIGKILL)
            return False

        return announce

    monkeypatch.setattr(dispatch, "_redealer", dies_at_a_redeal)
    with sharer_kept_busy():
        with pytest.raises(RuntimeError, match="dispatch"):
            dealt_until_killed(str(tmp_path / "killed"))  # its stop returns: the sharer is busy
    assert snapshot() == before


def test_a_redeal_whose_channels_do_not_come_ends_the_dispatch_process_saying_why(tmp_path, monkeypatch, capfd):
    """The dispatch process fetches a replacement's channels from this process's resource
    sharer, here kept busy by another peer: past its bound it ends, saying why, and the
    loop gets the dispatch process's death as its error instead of waiting for ever for
    the replacement's items; its channels are taken back once the sharer is free."""
    from mprs_plus.runtime.child import dispatch
    from test_release import snapshot

    dealt_until_killed(str(tmp_path / "first"))  # the sharer started
    sharer_done()  # the first run's hand-overs closed on the sharer's side too
    before = snapshot()
    monkeypatch.setattr(dispatch, "REDEAL_FETCH_SECONDS", 1.0)  # forked: the dispatch process has it
    with sharer_kept_busy():
        with pytest.raises(RuntimeError, match="dispatch"):
            dealt_until_killed(str(tmp_path / "killed"))
    assert (tmp_path / "killed").exists()
    assert "the channels of a replaced worker did not come from the training process within 1 s" in capfd.readouterr().err
    assert snapshot() == before
