"""Accelerate and Transformers' Trainer on the engine (``mprs_plus.integrations.accelerate``).

What a user checks, each against torch's DataLoader under the same Accelerate: the loader
Accelerate prepares is ours; its batches are torch's for the same seed, per process when
sharded; ``skip_first_batches`` and ``save_state``/``load_state`` resume exactly, random
augmentations included; ``set_epoch`` reaches the sampler; a loader's own arguments
survive the rebuild; a release outside the range tested is refused with what to do.
Trainer trains on the engine with torch's batches and resumes a checkpoint exactly.

Skipped where Accelerate (for the Trainer tests, Transformers) is not installed.
"""

from __future__ import annotations

import ast
import gc
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler, IterableDataset, get_worker_info

accelerate = pytest.importorskip("accelerate")

import mprs_plus  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.data_loader import DataLoaderAdapter, prepare_data_loader, skip_first_batches  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from mprs_plus.integrations import accelerate as integration  # noqa: E402

LENGTH = 24


class Noisy(Dataset):
    """A sample and a random augmentation drawn in the worker: exact only if every worker
    is seeded and fed as in the run compared with."""

    def __len__(self):
        return LENGTH

    def __getitem__(self, i):
        return torch.tensor([float(i), float(torch.rand(()))])


class Counting(IterableDataset):
    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for i in range(worker, LENGTH, workers):
            yield torch.tensor([float(i), float(torch.rand(()))])


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each test starts with Accelerate's process-wide state unset and the integration off."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    integration.disable()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    gc.collect()  # iterators left mid-epoch stop their workers


@pytest.fixture
def enabled():
    integration.enable()
    yield
    integration.disable()


def _loader(cls=torch.utils.data.DataLoader, dataset=None, **kwargs):
    kwargs = {"batch_size": 3, "shuffle": True, "num_workers": 2, **kwargs}
    return cls(dataset if dataset is not None else Noisy(), **kwargs)


def _batches(loader):
    return [batch.tolist() for batch in loader]


def _prepared_batches(enable, epochs=1, **kwargs):
    """The batches of the prepared loader (torch's loader handed to prepare()), from seed 0."""
    if enable:
        integration.enable()
    try:
        torch.manual_seed(0)
        prepared = Accelerator(cpu=True).prepare(_loader(**kwargs))
        return prepared, [_batches(prepared) for _ in range(epochs)]
    finally:
        integration.disable()
        AcceleratorState._reset_state(reset_partial_state=True)


# -- the engine, torch's batches ---------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_prepared_loader_runs_on_the_engine_with_torchs_batches(num_workers):
    theirs, torch_epochs = _prepared_batches(False, epochs=2, num_workers=num_workers)
    ours, our_epochs = _prepared_batches(True, epochs=2, num_workers=num_workers)
    assert type(theirs.base_dataloader) is torch.utils.data.DataLoader
    assert type(ours.base_dataloader) is mprs_plus.DataLoader
    assert isinstance(ours, mprs_plus.DataLoader)  # Accelerate's wrapper reports the class it wraps
    assert our_epochs == torch_epochs
    assert our_epochs[0] != our_epochs[1]


@pytest.mark.parametrize(
    "config", [{"dispatch_batches": True}, {"split_batches": True}, {"use_stateful_dataloader": True}], ids=str
)
@pytest.mark.parametrize("dataset", [Noisy, Counting], ids=["map-style", "iterable"])
def test_accelerates_loader_options_keep_the_engine_and_torchs_batches(config, dataset):
    from accelerate.utils import DataLoaderConfiguration

    def prepared(enable):
        if enable:
            integration.enable()
        try:
            AcceleratorState._reset_state(reset_partial_state=True)
            torch.manual_seed(0)
            accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**config))
            loader = accelerator.prepare(_loader(dataset=dataset(), shuffle=True if dataset is Noisy else None))
            return type(loader.base_dataloader), _batches(loader)
        finally:
            integration.disable()

    (_, theirs), (kind, ours) = prepared(False), prepared(True)
    assert kind is mprs_plus.DataLoader
    assert ours == theirs


def test_loaders_prepared_after_disable_are_accelerates_own_again():
    integration.enable()
    integration.disable()
    torch.manual_seed(0)
    prepared = Accelerator(cpu=True).prepare(_loader())
    assert type(prepared.base_dataloader) is torch.utils.data.DataLoader


def test_an_iterable_dataset_gives_torchs_batches():
    _, torch_epochs = _prepared_batches(False, dataset=Counting(), shuffle=None)
    ours, our_epochs = _prepared_batches(True, dataset=Counting(), shuffle=None)
    assert type(ours.base_dataloader) is mprs_plus.DataLoader
    assert our_epochs == torch_epochs


@pytest.mark.parametrize("dataset", [Noisy, Counting], ids=["map-style", "iterable"])
def test_each_process_gets_torchs_share(dataset):
    """Two processes, as Accelerate shards for them (the process count and index given
    as a launcher gives them): each process's batches are torch's for that process."""

    def shares(enable):
        if enable:
            integration.enable()
        try:
            result = []
            for process in range(2):
                torch.manual_seed(0)
                shuffle = True if dataset is Noisy else None
                prepared = prepare_data_loader(_loader(dataset=dataset(), shuffle=shuffle), num_processes=2, process_index=process)
                result.append((type(prepared.base_dataloader), _batches(prepared)))
            return result
        finally:
            integration.disable()

    theirs, ours = shares(False), shares(True)
    assert [kind for kind, _ in ours] == [mprs_plus.DataLoader] * 2
    assert [batches for _, batches in ours] == [batches for _, batches in theirs]
    first, second = (batches for _, batches in ours)
    assert first and second and first != second


def test_two_processes_under_gloo_each_get_torchs_batches():
    """A real two-process run (CPU, gloo), as ``accelerate launch`` starts it: in each
    process the engine gives torch's batches, epoch after epoch, and together the two
    processes read the whole dataset."""
    import json
    import os
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = Path(__file__).with_name("accelerate_ranks_script.py")
    root = str(Path(__file__).resolve().parent.parent)
    processes = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        }
        processes.append(subprocess.Popen([sys.executable, "-W", "ignore", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outputs = [process.communicate(timeout=90) for process in processes]
    finally:
        for process in processes:
            process.kill()
            process.wait()
    for process, (_, err) in zip(processes, outputs):
        assert process.returncode == 0, err[-3000:]
    results = sorted((json.loads(out.strip().splitlines()[-1]) for out, _ in outputs), key=lambda r: r["process"])
    assert [r["processes"] for r in results] == [2, 2]
    for result in results:
        assert result["ours"][0] == "mprs_plus.dataloader.loader"
        assert result["ours"][1] == result["torch"][1]
    for epoch in (0, 1):
        read = [int(row[0]) for r in results for batch in r["ours"][1][epoch] for row in batch]
        assert set(read) == set(range(26))


def test_set_epoch_reaches_the_sampler():
    def epochs(enable):
        if enable:
            integration.enable()
        try:
            dataset = Noisy()
            sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=3)
            torch.manual_seed(0)
            prepared = Accelerator(cpu=True).prepare(_loader(dataset=dataset, shuffle=None, sampler=sampler))
            result = []
            for epoch in (0, 1):
                prepared.set_epoch(epoch)
                result.append(_batches(prepared))
            return result, sampler.epoch
        finally:
            integration.disable()
            AcceleratorState._reset_state(reset_partial_state=True)

    (theirs, _), (ours, last_epoch) = epochs(False), epochs(True)
    assert ours == theirs
    assert last_epoch == 1
    assert [row[0] for batch in ours[0] for row in batch] != [row[0] for batch in ours[1] for row in batch]


def test_the_loaders_own_arguments_survive_the_rebuild(enabled):
    source = _loader(
        mprs_plus.DataLoader, pin_memory=True, device="cuda", collect_stats=False, snapshot_every_n_steps=4, worker_restarts=2
    )
    prepared = Accelerator(cpu=True).prepare(source)
    built = prepared.base_dataloader
    assert (built.device, built.collect_stats, built.snapshot_every_n_steps, built.worker_restarts) == ("cuda", False, 4, 2)
    assert built._prefetch_asked is None  # not asked: the workers run ahead as far as their channels let them
    skipped = skip_first_batches(prepared, 2).base_dataloader
    own = (skipped.device, skipped.collect_stats, skipped.snapshot_every_n_steps, skipped.worker_restarts)
    assert own == ("cuda", False, 4, 2)


def test_the_loader_the_user_holds_reports_the_stats_of_the_one_that_runs(enabled):
    source = _loader(mprs_plus.DataLoader)
    prepared = Accelerator(cpu=True).prepare(source)
    _batches(prepared)
    stats = source.stats()
    workers = [p for p in stats.processes if p.role == mprs_plus.Segment.WORKER]
    assert len(workers) == 2 and sum(p.items_out for p in workers) == LENGTH // 3
    assert stats == prepared.stats()



@pytest.mark.parametrize("given", ["ours", "torch's"])
def test_a_killed_worker_is_replaced_with_torchs_batches(tmp_path, given):
    """worker_restarts reaches the loader Accelerate builds: from a loader of this class,
    or from enable() for one of torch's (as Trainer makes). The kill is forced: sample 13
    SIGKILLs the worker that reads it, the first time."""
    from restart_datasets import Draws

    def prepared(dataset, loader_class=torch.utils.data.DataLoader, **kwargs):
        AcceleratorState._reset_state(reset_partial_state=True)
        torch.manual_seed(0)
        return Accelerator(cpu=True).prepare(loader_class(dataset, batch_size=4, shuffle=True, num_workers=2, **kwargs))

    expected = _batches(prepared(Draws(n=32)))
    killing = Draws(n=32, kill_at=13, marker=str(tmp_path / "killed"))
    integration.enable(**({} if given == "ours" else {"worker_restarts": 1}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if given == "ours":
            loader = prepared(killing, mprs_plus.DataLoader, worker_restarts=1)
        else:
            loader = prepared(killing)
        got = _batches(loader)
    assert (tmp_path / "killed").exists()
    assert got == expected
    assert [made.cause for made in loader.stats().replacements] == ["SIGKILL"]
    said = [w for w in caught if "A new worker replaces it" in str(w.message)]
    assert len(said) == 1
    assert said[0].filename == __file__  # the user's line, not Accelerate's wrapper


def test_enable_refuses_an_argument_torchs_loader_has(enabled):
    with pytest.raises(TypeError, match="num_workers"):
        integration.enable(num_workers=4)

# -- resuming exactly ----------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("skip", [1, 4, 7])
def test_skip_first_batches_goes_on_exactly(enabled, num_workers, skip):
    torch.manual_seed(0)
    uninterrupted = _batches(Accelerator(cpu=True).prepare(_loader(num_workers=num_workers)))
    AcceleratorState._reset_state(reset_partial_state=True)

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    resumed = accelerator.skip_first_batches(accelerator.prepare(_loader(num_workers=num_workers)), skip)
    assert type(resumed.base_dataloader) is mprs_plus.DataLoader
    assert _batches(resumed) == uninterrupted[skip:]  # the augmentations of the skipped batches' workers too
    assert len(_batches(resumed)) == len(uninterrupted)  # a later epoch is whole


@pytest.mark.parametrize("cls", [torch.utils.data.DataLoader, mprs_plus.DataLoader], ids=["torch", "ours"])
def test_skip_first_batches_of_a_loader_not_prepared_goes_on_exactly(enabled, cls):
    uninterrupted = _batches(_loader(cls, generator=torch.Generator().manual_seed(2)))
    resumed = skip_first_batches(_loader(cls, generator=torch.Generator().manual_seed(2)), 5)
    assert type(resumed) is mprs_plus.DataLoader
    assert _batches(resumed) == uninterrupted[5:]


def test_skip_first_batches_of_an_iterable_dataset_goes_on_exactly(enabled):
    torch.manual_seed(0)
    uninterrupted = _batches(Accelerator(cpu=True).prepare(_loader(dataset=Counting(), shuffle=None)))
    AcceleratorState._reset_state(reset_partial_state=True)
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    resumed = accelerator.skip_first_batches(accelerator.prepare(_loader(dataset=Counting(), shuffle=None)), 3)
    assert _batches(resumed) == uninterrupted[3:]


@pytest.mark.parametrize("taken_after", [0, 3, 8])
def test_save_state_and_load_state_resume_exactly(enabled, tmp_path, taken_after):
    def prepared():
        AcceleratorState._reset_state(reset_partial_state=True)
        accelerator = Accelerator(cpu=True)
        return accelerator, accelerator.prepare(_loader(generator=torch.Generator().manual_seed(5)))

    _, loader = prepared()
    first_epoch, second_epoch = _batches(loader), _batches(loader)

    accelerator, loader = prepared()
    batches = iter(loader)
    seen = [next(batches).tolist() for _ in range(taken_after)]
    accelerator.save_state(tmp_path / "checkpoint")
    del batches, loader
    saved = torch.load(tmp_path / "checkpoint" / "dl_state_dict.bin", weights_only=True)
    assert saved["format"].startswith("mprs_plus.DataLoader")

    accelerator, loader = prepared()
    accelerator.load_state(tmp_path / "checkpoint")
    accelerator.save_state(tmp_path / "again")  # before the first batch: the state just loaded
    assert torch.load(tmp_path / "again" / "dl_state_dict.bin", weights_only=True) == saved
    if taken_after < len(first_epoch):
        assert seen + _batches(loader) == first_epoch
    else:  # taken after the epoch's last batch: the next epoch follows
        assert seen == first_epoch and _batches(loader) == second_epoch


# -- what is refused ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["1.17.0", "2.0.0", "0.34.2", "not a version"])
def test_a_release_outside_the_range_tested_is_refused_saying_what_to_do(monkeypatch, version):
    monkeypatch.setattr(accelerate, "__version__", version)
    before = DataLoaderAdapter.__dict__["__init__"]
    with pytest.raises(RuntimeError) as raised:
        integration.enable()
    message = str(raised.value)
    assert f"accelerate {version} is installed" in message
    assert f"pip install 'accelerate{integration.SUPPORTED}'" in message
    assert "leave enable() out" in message
    assert DataLoaderAdapter.__dict__["__init__"] is before  # nothing replaced


def test_without_accelerate_enable_says_how_to_install_it():
    code = (
        "import sys; sys.modules['accelerate'] = None\n"  # as if it were not installed
        "from mprs_plus.integrations import accelerate as integration\n"
        "try:\n    integration.enable()\nexcept ImportError as exc:\n    print(exc)\n"
    )
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=60)
    assert f"needs Hugging Face Accelerate: pip install 'accelerate{integration.SUPPORTED}'" in result.stdout, result.stderr


def test_internals_not_shaped_as_tested_are_refused(monkeypatch):
    def moved(self, dataset, batch_sampler=None, **kwargs):
        raise AssertionError("never called")

    monkeypatch.setattr(DataLoaderAdapter, "__init__", moved)
    with pytest.raises(RuntimeError, match="is not shaped as the releases"):
        integration.enable()
    assert DataLoaderAdapter.__dict__["__init__"] is moved


def test_only_the_integration_imports_accelerate():
    package = Path(mprs_plus.__file__).resolve().parent
    importers = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            # import_module("accelerate...") counts as well
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args:
                names += [getattr(node.args[0], "value", "")]
            if any(str(name).split(".")[0] in ("accelerate", "transformers") for name in names):
                importers.add(str(path.relative_to(package)))
    assert importers == {"integrations/accelerate.py"}
    code = "import sys, mprs_plus, mprs_plus.dataloader, mprs_plus.integrations; assert 'accelerate' not in sys.modules"
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# -- Transformers' Trainer ---------------------------------------------------------------------


class Regressor(torch.nn.Module):
    """A model Trainer can train (forward returns the loss), recording what it was fed."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)
        self.seen: list[list[float]] = []

    def forward(self, x, labels):
        self.seen.append(x.flatten().tolist())
        return {"loss": torch.nn.functional.mse_loss(self.linear(x), labels)}


class Pairs(Dataset):
    def __len__(self):
        return LENGTH

    def __getitem__(self, i):
        x = i / LENGTH + 0.01 * float(torch.rand(()))  # augmented in the worker
        return {"x": torch.tensor([x]), "labels": torch.tensor([2 * x])}


def _train(output_dir, resume_from=None, **arguments):
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        num_train_epochs=2,
        learning_rate=0.1,
        save_strategy="steps",
        save_steps=2,
        logging_strategy="no",
        report_to="none",
        use_cpu=True,
        dataloader_num_workers=2,
        disable_tqdm=True,
        seed=0,
        **arguments,
    )
    torch.manual_seed(0)
    model = Regressor()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Pairs())
    trainer.train(resume_from_checkpoint=resume_from)
    loader = trainer.get_train_dataloader()
    return model, loader


def test_trainer_trains_on_the_engine_with_torchs_batches(tmp_path):
    theirs, torch_loader = _train(tmp_path / "torch")
    integration.enable()
    ours, our_loader = _train(tmp_path / "ours")
    assert type(torch_loader.base_dataloader) is torch.utils.data.DataLoader
    assert type(our_loader.base_dataloader) is mprs_plus.DataLoader
    assert len(ours.seen) == 12 and ours.seen == theirs.seen
    assert torch.equal(ours.linear.weight, theirs.linear.weight)


@pytest.mark.parametrize("step", [2, 6], ids=["mid-epoch", "between-epochs"])
def test_trainer_resumes_a_checkpoint_exactly(tmp_path, enabled, step):
    uninterrupted, _ = _train(tmp_path)
    # Step 2 of 6 in the first epoch: Trainer skips the first two batches of the epoch.
    resumed, _ = _train(tmp_path / "resumed", resume_from=tmp_path / f"checkpoint-{step}")
    assert resumed.seen == uninterrupted.seen[step:]
    assert torch.equal(resumed.linear.weight, uninterrupted.linear.weight)
    assert torch.equal(resumed.linear.bias, uninterrupted.linear.bias)


def test_a_state_restores_at_another_number_of_processes():
    """Accelerate deals whole batches to its processes (BatchSamplerShard): a state of one
    of 4 processes, 1 batch each in, restores each of 3 (seeding="batch"): every remaining
    sample once (Accelerate's padding to whole rounds aside), none made before again."""
    integration.enable(seeding="batch")

    def process(count, index):
        torch.manual_seed(0)  # every process seeded alike: they draw the same order
        prepared = prepare_data_loader(_loader(num_workers=0), num_processes=count, process_index=index)
        return prepared.base_dataloader

    made = []
    for index in range(4):
        loader = process(4, index)
        assert loader.seeding == "batch"
        batches = iter(loader)
        made += [int(row[0]) for row in next(batches).tolist()]
        state = loader.state_dict()
        del batches
    rest = []
    for index in range(3):
        loader = process(3, index)
        loader.load_state_dict(state)
        rest += [int(row[0]) for batch in loader for row in batch.tolist()]
    assert len(set(made)) == 12 and not set(made) & set(rest)
    assert sorted(set(made) | set(rest)) == list(range(LENGTH))
    assert len(rest) - len(set(rest)) <= 2 * 3  # two batches repeated to fill the last round
