"""Mid-epoch checkpoints: take one, resume it in a new Python process, compare with the
uninterrupted run (same seed) item by item, for the rest of that epoch and 3 more."""

from __future__ import annotations

import itertools
import json
import pathlib
import subprocess
import sys

import pytest
from ranks import run_ranks
from torch.utils.data import IterDataPipe
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

import mprs_plus
from mprs_plus._cli.demo import NonReplicable  # the demo's own main-process stage
from mprs_plus.resume_state import Phase, ResumeState

SCRIPT = pathlib.Path(__file__).with_name("checkpoint_script.py")
EPOCH = 43  # items per epoch of the script's pipelines (n=50, 7 filtered out)


def _run(action: str, cases: dict[str, dict], folder: pathlib.Path, timeout: float = 100) -> dict[str, dict]:
    """The script's ``action`` for every case, in one fresh interpreter; a case that
    raised comes back as {"error": its traceback}."""
    done = subprocess.run(
        [sys.executable, "-W", "ignore", str(SCRIPT), action, json.dumps(cases), str(folder)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _config(**overrides: object) -> dict:
    config = {
        "pipe": "workers",
        "n": 50,
        "workers": 3,
        "ctx": "fork",
        "in_order": True,
        "at": 13,
        "paused": False,
        "load": "from_state",
    }
    config.update(overrides)
    return config


def check_resume(tmp_path: pathlib.Path, **overrides: object) -> None:
    """One case: checkpointed in a fresh interpreter, resumed in another."""
    config = _config(**overrides)
    saved = _run("save", {"case": config}, tmp_path)["case"]
    resumed = _run("resume", {"case": config}, tmp_path)["case"]
    check_outcome(config, saved, resumed)


def check_outcome(config: dict, saved: dict, resumed_run: dict) -> None:
    """The resumed run goes on exactly as the uninterrupted one (same seed) did."""
    assert "error" not in saved, saved.get("error")
    assert "error" not in resumed_run, resumed_run.get("error")
    resumed = resumed_run["epochs"]
    reference, got = saved["reference"], saved["got"]
    assert all(len(epoch) == EPOCH for epoch in reference)
    if config["at"] == "end":
        assert len(resumed) == 3
        expected_rest, later, resumed_later = None, reference[1:], resumed
        assert sorted(got) == sorted(reference[0])
    else:
        assert len(got) == config["at"]
        expected_rest, later, resumed_later = reference[0][len(got) :], reference[1:], resumed[1:]
    if config["in_order"]:
        if expected_rest is not None:
            assert got == reference[0][: len(got)]
            assert resumed[0] == expected_rest  # the same items in the same order
        assert resumed_later == later  # and identical later epochs
        if saved["tail"] is not None:
            assert got + saved["tail"] == reference[0]  # taking it while paused changed nothing
    else:
        if expected_rest is not None:
            # Exactly the items the user had not received: none lost, none twice.
            assert sorted(got + resumed[0]) == sorted(reference[0])
        assert [sorted(e) for e in resumed_later] == [sorted(e) for e in later]


RESUME_CASES = {
    "mid": {},
    "item0_load_state_dict": {"at": 0, "load": "load_state_dict"},
    "last_item": {"at": EPOCH},
    "after_epoch_end": {"at": "end"},
    "paused": {"paused": True, "at": 20},
    "dispatch": {"pipe": "dispatch"},
    # Taken under fork, restored under spawn: the restored processes get everything pickled.
    "dispatch_restored_under_spawn": {"pipe": "dispatch", "resume_ctx": "spawn", "at": 30},
    "as_ready_exact_set": {"in_order": False},
    "checkpoint_of_a_restored_epoch": {"again": 9},
    "main_segment_replayed": {"pipe": "main", "at": 17},
    "in_process": {"workers": 0, "at": 11},
    "dispatch_as_ready_exact_set": {"pipe": "dispatch", "in_order": False, "at": 25},
}
CASES_TIMEOUT = 400  # seconds for all the cases' checkpoints (or resumes) on a loaded machine


@pytest.fixture(scope="module")
def resumed_cases(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """Every case checkpointed in one fresh interpreter and resumed in another: a resume
    still runs in a process that never saw its checkpoint taken, and two interpreter
    starts serve all the cases instead of two per case."""
    folder = tmp_path_factory.mktemp("checkpoints")
    cases = {name: _config(**overrides) for name, overrides in RESUME_CASES.items()}
    saved = _run("save", cases, folder, timeout=CASES_TIMEOUT)
    resumed = _run("resume", cases, folder, timeout=CASES_TIMEOUT)
    return {name: (saved[name], resumed[name]) for name in cases}


@pytest.mark.timeout(2 * CASES_TIMEOUT + 60)  # the first case waits for the module's two runs
@pytest.mark.parametrize("case", RESUME_CASES)
def test_resume_in_new_process(resumed_cases, case):
    check_outcome(_config(**RESUME_CASES[case]), *resumed_cases[case])


@pytest.mark.stress
@pytest.mark.parametrize(
    "pipe, ctx, in_order, at",
    list(itertools.product(["workers", "dispatch"], ["fork", "spawn", "forkserver"], [True, False], [0, 7, 42, 43])),
)
def test_resume_matrix(tmp_path, pipe, ctx, in_order, at):
    check_resume(tmp_path, pipe=pipe, ctx=ctx, in_order=in_order, at=at)


def test_restore_benchmark_runs_and_checks_where_it_resumes():
    # The benchmark asserts that each restored loader yields the item that followed the checkpoint.
    done = subprocess.run(
        [sys.executable, str(SCRIPT.parent.parent / "benchmarks" / "checkpoint.py"), "--items", "200", "--kib", "16",
         "--repetitions", "1"],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line.split()[0] for line in done.stdout.splitlines()[2:]] == ["10%", "50%", "90%"]


# -- in-process: the limits, stated as errors ---------------------------------------------


def _square(x: int) -> int:
    return x * x


def _loader(num_workers: int, pipe: object = None) -> DataLoader2:
    pipe = pipe if pipe is not None else IterableWrapper(range(20)).sharding_filter().map(_square)
    service = mprs_plus.MultiProcessingReadingService(num_workers=num_workers, multiprocessing_context="fork")
    return DataLoader2(pipe, reading_service=service)


def test_other_worker_count_is_refused_naming_both():
    loader = _loader(2)
    try:
        iterator = iter(loader)
        next(iterator)
        state = loader.state_dict()
    finally:
        loader.shutdown()
    other = DataLoader2.from_state(
        state, mprs_plus.MultiProcessingReadingService(num_workers=3, multiprocessing_context="fork")
    )
    try:
        with pytest.raises(ValueError, match=r"num_workers=2.*num_workers=3"):
            iter(other)
    finally:
        other.shutdown()


def test_main_segment_with_state_needs_in_order_mid_epoch_but_not_between_epochs():
    pipe = NonReplicable(IterableWrapper(range(20)).sharding_filter().map(_square)).shuffle()
    service = mprs_plus.MultiProcessingReadingService(num_workers=2, multiprocessing_context="fork", in_order=False)
    loader = DataLoader2(pipe, reading_service=service)
    try:
        before = ResumeState.from_bytes(loader.state_dict()["reading_service_state"])
        assert before.phase is Phase.NOT_STARTED
        iterator = iter(loader)
        next(iterator)
        with pytest.raises(ValueError, match="in_order=True"):
            loader.state_dict()
        list(iterator)
        after = ResumeState.from_bytes(loader.state_dict()["reading_service_state"])
        assert after.phase is Phase.ENDED
    finally:
        loader.shutdown()


def test_checkpoint_before_the_first_epoch_starts_as_new():
    loader = _loader(2)
    loader.seed(3)
    try:
        expected = list(loader)
    finally:
        loader.shutdown()
    fresh = _loader(2)
    fresh.seed(3)
    state = fresh.state_dict()
    fresh.shutdown()
    restored = DataLoader2.from_state(
        state, mprs_plus.MultiProcessingReadingService(num_workers=2, multiprocessing_context="fork")
    )
    try:
        assert list(restored) == expected
    finally:
        restored.shutdown()


def test_bytes_that_are_no_checkpoint_are_refused():
    with pytest.raises(ValueError, match="not a checkpoint"):
        ResumeState.from_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a checkpoint"):
        ResumeState.from_bytes(b"\x80\x04K\x01.")  # a pickled 1


# -- two ranks: SequentialReadingService(DistributedReadingService(), ours) -----------------

DISTRIBUTED_SCRIPT = pathlib.Path(__file__).with_name("distributed_checkpoint_script.py")


def _run_ranks(folder: pathlib.Path, action: str) -> list[dict]:
    run_ranks(DISTRIBUTED_SCRIPT, 2, lambda rank, port: [str(rank), "2", str(port), str(folder), action])
    return [json.loads((folder / f"{rank}-{action}.json").read_text()) for rank in range(2)]


def test_each_rank_resumes_its_own_stream(tmp_path):
    saved = _run_ranks(tmp_path, "save")
    resumed = _run_ranks(tmp_path, "resume")
    for rank in range(2):
        reference, got, epochs = saved[rank]["reference"], saved[rank]["got"], resumed[rank]["epochs"]
        assert all(len(epoch) == 20 for epoch in reference)
        assert got == reference[0][:7]
        assert epochs[0] == reference[0][7:]
        assert epochs[1:] == reference[1:]
    # The ranks read disjoint shards that cover the dataset, before and after the restore.
    assert sorted(saved[0]["reference"][1] + saved[1]["reference"][1]) == [3 * x for x in range(40)]


# -- the resume_from hook --------------------------------------------------------------------


class IndexedSource(IterDataPipe):
    """A sharded source that can start at any position: it implements ``resume_from`` and
    leaves a note (shard -> items skipped) in ``notes`` when it is used."""

    def __init__(self, n: int, notes: str) -> None:
        self.n, self.notes = n, notes
        self.shards, self.shard = 1, 0

    def apply_sharding(self, num_of_instances: int, instance_id: int, sharding_group: object = None) -> None:
        self.shards, self.shard = num_of_instances, instance_id

    def __iter__(self):
        return iter(range(self.shard, self.n, self.shards))

    def resume_from(self, skip: int):
        (pathlib.Path(self.notes) / str(self.shard)).write_text(str(skip))
        return iter(range(self.shard + skip * self.shards, self.n, self.shards))


def test_a_datapipe_with_resume_from_starts_there_instead_of_producing_the_skipped_items(tmp_path):
    def loader_of(source: IterDataPipe) -> DataLoader2:
        service = mprs_plus.MultiProcessingReadingService(num_workers=2, multiprocessing_context="fork")
        return DataLoader2(source, reading_service=service)

    loader = loader_of(IndexedSource(30, str(tmp_path)))
    try:
        iterator = iter(loader)
        got = [next(iterator) for _ in range(7)]
        state = loader.state_dict()
    finally:
        loader.shutdown()
    assert got == list(range(7))
    restored = DataLoader2.from_state(
        state, mprs_plus.MultiProcessingReadingService(num_workers=2, multiprocessing_context="fork")
    )
    try:
        assert list(restored) == list(range(7, 30))
        assert list(restored) == list(range(30))  # the next epoch starts from the beginning
    finally:
        restored.shutdown()
    # Worker 0 had handed out 0, 2, 4, 6 and worker 1 had handed out 1, 3, 5.
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {"0": "4", "1": "3"}
