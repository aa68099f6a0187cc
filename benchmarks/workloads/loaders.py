"""The loader comparison's contenders and workloads: torch's loader API, four implementations.

    loader_compare.py --> workloads(our, jpegs)      map-style datasets, torch's batching
                            runner per contender --> harness.stream(open_loader(...))
                                                     or first_batch(open_loader(...))

Every contender gets the same dataset and the same arguments, as a user who switches one
import line passes them: ``batch_size``, ``shuffle``, ``num_workers`` and the start method;
everything else is the loader's default.

    mprs_plus           mprs_plus.DataLoader
    DataLoader          torch.utils.data.DataLoader
    StatefulDataLoader  torchdata's StatefulDataLoader (its default snapshot_every_n_steps=1)
    SPDL                spdl.dataloader.get_pytorch_dataloader (its default in_order=False)

and two references: torch's DataLoader with no workers (the cheap samples and the whole
short epochs, where workers must beat doing the work in the loop's own process) and mprs_plus
without ``state_dict()`` (what taking the state after every batch costs it).

A contender that refuses a workload's arguments (SPDL refuses iterable datasets,
``worker_init_fn`` and ``persistent_workers``) raises ``harness.NotApplicable``: the
comparison records it as n/a with the loader's own reason, not as a failure.

Datasets are module-level classes, so that they pickle by reference under every start
method and SPDL can copy them into its workers. ``Rows`` and ``FullTensors`` are the cheap
samples' datasets (``cheap_samples.py``, ``loader_compare.py --cheap-samples``).
"""

from __future__ import annotations

import functools
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.data

from .. import harness
from ._shared import Ints, burn, torch_tensor

MPRS_PLUS = "mprs_plus"
TORCH = "DataLoader"
STATEFUL = "StatefulDataLoader"
SPDL = "SPDL"
PEERS = (TORCH, STATEFUL, SPDL)
TORCH_NO_WORKERS = "DataLoader, 0 workers"
MPRS_PLUS_NO_STATE = "mprs_plus, no state_dict()"
CONTENDERS = (MPRS_PLUS, *PEERS, TORCH_NO_WORKERS, MPRS_PLUS_NO_STATE)
MAIN_COLUMNS = (MPRS_PLUS, *PEERS)  # the table's value columns; the other two are references

SAMPLES = harness.Metric("throughput", "samples/s")
BANDWIDTH = harness.Metric("throughput", "GB/s")
FIRST_BATCH = harness.Metric("first_batch", "s", higher_is_better=False)


# -- which class plays mprs_plus ---------------------------------------------------------------


@dataclass(frozen=True)
class OurLoader:
    """The class measured as ``mprs_plus``, or why there is none (then the column is n/a)."""

    cls: type | None
    missing: str | None = None
    stand_in: bool = False


def our_loader(stand_in: bool = False) -> OurLoader:
    """``mprs_plus.DataLoader``; with ``stand_in``, torchdata's StatefulDataLoader in its place.

    The stand-in has torch's constructor and a ``state_dict()``, so every workload runs: it
    tries the comparison's machinery out, and its figures say nothing about mprs_plus.
    """
    if stand_in:
        from torchdata.stateful_dataloader import StatefulDataLoader

        return OurLoader(StatefulDataLoader, stand_in=True)
    try:
        from mprs_plus import DataLoader
    except ImportError as exc:
        return OurLoader(
            None,
            missing=f"mprs_plus.DataLoader is not importable ({exc}); --stand-in runs the comparison "
            "with torchdata's StatefulDataLoader in its place",
        )
    return OurLoader(DataLoader)


# -- datasets ----------------------------------------------------------------------------------


class Made(torch.utils.data.Dataset):
    """Sample ``i`` is ``fn(i)``, made in whichever process fetches it."""

    def __init__(self, n: int, fn: Callable[[int], Any]) -> None:
        self.n = n
        self.fn = fn

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        return self.fn(index)


class Jpegs(torch.utils.data.Dataset):
    """Sample ``i`` decodes JPEG file ``i % len(paths)`` with Pillow into an HxWx3 uint8 tensor.

    The epoch is longer than the folder: the files stay in the page cache, so what is
    measured is decoding, not the disk."""

    def __init__(self, paths: list[str], n: int) -> None:
        self.paths = paths
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        from PIL import Image

        with Image.open(self.paths[index % len(self.paths)]) as image:
            return torch.from_numpy(np.array(image.convert("RGB")))


class Rows(torch.utils.data.Dataset):
    """``rows`` rows of ``features`` random float32 values held in memory; sample ``i`` is
    ``self.data[i]``, a view of row ``i``: the cheapest sample a map-style dataset has."""

    def __init__(self, rows: int, features: int = 256) -> None:
        self.data = torch.randn(rows, features)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]


class FullTensors(torch.utils.data.Dataset):
    """Sample ``i`` is a fresh 1 MiB float32 tensor, ``torch.full((1 << 18,), float(i))``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((1 << 18,), float(index))


def make_jpegs(folder: Path, count: int, size: int = 256, seed: int = 0) -> list[str]:
    """``count`` JPEGs of ``size`` x ``size`` in ``folder``: smooth gradients with noise, so that
    they compress and decode as photographs do rather than as flat colour or pure noise."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, size, dtype=np.float32)
    paths = []
    for i in range(count):
        tilt = rng.uniform(0.2, 1.0, size=3)
        base = ramp[:, None, None] * tilt + ramp[None, :, None] * (1 - tilt)
        pixels = np.clip(base + rng.normal(0, 12, size=(size, size, 3)), 0, 255).astype(np.uint8)
        path = folder / f"{i:04d}.jpg"
        Image.fromarray(pixels).save(path, quality=90)
        paths.append(str(path))
    return paths


class JpegFolder:
    """A temporary folder of generated JPEGs for one run; ``close()`` removes it."""

    def __init__(self, count: int) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="loader-compare-jpegs-"))
        try:
            self.paths = make_jpegs(self.path, count)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


# -- contenders --------------------------------------------------------------------------------


class TorchStyleLoader(harness.Loader):
    """A loader with torch's interface, iterated once; ``state_every_batch`` takes
    ``loader.state_dict()`` after every batch, when the training loop hands the batch back.

    ``close()`` ends its workers now, so that the time falls inside the measurement and
    nothing is left for the next contender: torch's (and StatefulDataLoader's)
    ``_shutdown_workers``, else the iterator's ``close()`` (SPDL's generator), then the
    loader's ``shutdown()`` or ``close()`` where it has one; and it drops the iterator, whose
    finalizer stops whatever is left (mprs_plus.DataLoader's iterator stops its workers
    there). Then ``after_close`` (SPDL's shared memory).

    ``in_loop`` hands the batches through the same Python loop as ``state_every_batch``,
    without taking the state: the reference it is compared with then differs from it by
    the ``state_dict()`` call alone, not by the loop around it.
    """

    def __init__(
        self,
        loader: Any,
        *,
        state_every_batch: bool = False,
        in_loop: bool = False,
        after_close: Callable[[], None] | None = None,
    ) -> None:
        self.loader = loader
        self.states_taken = 0
        self._state_every_batch = state_every_batch
        self._in_loop = in_loop or state_every_batch
        self._after_close = after_close
        self._iterator: Any = None
        super().__init__(loader, self._shutdown)

    def __iter__(self) -> Iterator[Any]:
        self._iterator = iter(self.loader)
        return self._loop(self._iterator) if self._in_loop else self._iterator

    def _loop(self, iterator: Iterator[Any]) -> Iterator[Any]:
        for batch in iterator:
            yield batch
            if self._state_every_batch:
                self.loader.state_dict()
                self.states_taken += 1

    def _shutdown(self) -> None:
        iterator, self._iterator = self._iterator, None
        try:
            stop = getattr(iterator, "_shutdown_workers", None) or getattr(iterator, "close", None)
            if stop is not None:
                stop()
            for name in ("shutdown", "close"):
                method = getattr(self.loader, name, None)
                if callable(method):
                    method()
                    break
        finally:
            if self._after_close is not None:
                self._after_close()


def open_loader(
    contender: str,
    our: OurLoader,
    settings: harness.Settings,
    dataset: Any,
    *,
    batch_size: int,
    shuffle: bool = False,
    state_every_batch: bool = False,
    in_loop: bool = False,
) -> TorchStyleLoader:
    """The contender's loader over ``dataset`` with torch's arguments (see the module's doc)."""
    arguments = dict(batch_size=batch_size, shuffle=shuffle, num_workers=settings.num_workers)
    arguments["multiprocessing_context"] = settings.context
    if contender in (MPRS_PLUS, MPRS_PLUS_NO_STATE):
        if our.cls is None:
            raise RuntimeError(our.missing)
        return TorchStyleLoader(our.cls(dataset, **arguments), state_every_batch=state_every_batch, in_loop=in_loop)
    if contender == TORCH:
        return TorchStyleLoader(torch.utils.data.DataLoader(dataset, **arguments))
    if contender == TORCH_NO_WORKERS:
        arguments.update(num_workers=0, multiprocessing_context=None)
        return TorchStyleLoader(torch.utils.data.DataLoader(dataset, **arguments))
    if contender == STATEFUL:
        from torchdata.stateful_dataloader import StatefulDataLoader

        return TorchStyleLoader(StatefulDataLoader(dataset, **arguments), state_every_batch=state_every_batch)
    if contender == SPDL:
        return _spdl_loader(dataset, arguments)
    raise ValueError(f"unknown contender {contender!r}; choose from {CONTENDERS}")


def _spdl_loader(dataset: Any, arguments: dict[str, Any]) -> TorchStyleLoader:
    from spdl.dataloader import get_pytorch_dataloader

    try:
        loader = get_pytorch_dataloader(dataset, **arguments)
    except ValueError as exc:  # its refusals: iterable datasets, worker_init_fn, persistent_workers
        raise harness.NotApplicable(f"get_pytorch_dataloader refuses it: {exc}") from exc
    # SPDL copies the dataset into a shared-memory segment that it never unlinks (the
    # resource tracker would, at the interpreter's exit, with a warning): done at close.
    segment = loader._shmem

    def release() -> None:
        segment.close()
        segment.unlink()

    return TorchStyleLoader(loader, after_close=release)


def spdl_missing() -> str | None:
    """Why SPDL's loader cannot run here, or None when it can."""
    try:
        from spdl.dataloader import get_pytorch_dataloader  # noqa: F401
    except ImportError as exc:
        return f"spdl is not installed ({exc}); 'pip install -e .[bench]' brings it"
    return None


# -- measuring ---------------------------------------------------------------------------------


def throughput(
    open_: Callable[[], TorchStyleLoader],
    settings: harness.Settings,
    samples: int,
    batch_size: int,
    sample_bytes: int = 0,
) -> dict[str, Any]:
    """``harness.stream`` over batches, reported per sample: samples/s, or GB/s with
    ``sample_bytes``; and the CPU seconds per sample of the main process and of each worker
    (``main_cpu_per_sample``, ``workers_cpu_per_sample``) over the timed window."""
    batches = math.ceil(samples / batch_size)
    result = harness.stream(open_, items=batches, settings=settings)
    rate = result.pop("throughput") * batch_size
    result["samples_per_s"] = rate
    result["throughput"] = rate * sample_bytes / harness.GB if sample_bytes else rate
    result["main_cpu_per_sample"] = result["main_cpu_per_item"] / batch_size
    result["workers_cpu_per_sample"] = [cpu / batch_size for cpu in result["children_cpu_per_item"]]
    return result


def whole_epoch(
    open_: Callable[[], TorchStyleLoader],
    settings: harness.Settings,
    samples: int,
    batch_size: int,
    sample_bytes: int = 0,
) -> dict[str, Any]:
    """One short epoch timed whole, from building the loader to its last batch (start-up
    included, as a validation epoch pays it): samples/s, or GB/s with ``sample_bytes``."""
    start = time.perf_counter()
    loader = open_()
    count = 0
    try:
        for _ in loader:
            count += 1
        elapsed = time.perf_counter() - start
    except BaseException:
        harness.close_within(loader, settings)
        raise
    problem = harness.close_within(loader, settings)
    if count != math.ceil(samples / batch_size):
        raise RuntimeError(f"the epoch yielded {count} batches, expected {math.ceil(samples / batch_size)}")
    rate = samples / elapsed
    result: dict[str, Any] = {
        "throughput": rate * sample_bytes / harness.GB if sample_bytes else rate,
        "epoch_s": elapsed,
    }
    if problem:
        result["problems"] = [f"after the epoch: {problem}"]
    return result


def first_batch(open_: Callable[[], TorchStyleLoader], settings: harness.Settings) -> dict[str, Any]:
    """Seconds from building the loader to holding its first batch (construction included,
    as a training script pays it); the loader is then shut down with its workers busy.

    Also the child processes running at the first batch: a loader that got its first batch
    early by loading in the main process shows it here."""
    start = time.perf_counter()
    loader = open_()
    try:
        next(iter(loader))
        elapsed = time.perf_counter() - start
        processes = len(harness.child_processes())
    except BaseException:
        harness.close_within(loader, settings)
        raise
    problem = harness.close_within(loader, settings)
    result: dict[str, Any] = {"first_batch": elapsed, "processes": processes}
    if problem:
        result["problems"] = [f"after the first batch: {problem}"]
    return result


# -- workloads ---------------------------------------------------------------------------------


# A workload's dataset for the run's settings, with its epoch length in samples.
Make = Callable[[harness.Settings], tuple[Any, int]]


def _run(
    contender: str,
    our: OurLoader,
    make: Make,
    batch_size: int,
    settings: harness.Settings,
    *,
    shuffle: bool = False,
    sample_bytes: int = 0,
    measure: str = "throughput",
) -> dict[str, Any]:
    """One measurement of ``contender``: ``throughput``, the same with the state taken after
    every batch (``state``; mprs_plus and StatefulDataLoader), the ``first_batch``, or a
    whole short ``epoch`` with its start-up."""
    dataset, samples = make(settings)
    state = measure == "state" and contender in (MPRS_PLUS, STATEFUL)
    opened: list[TorchStyleLoader] = []

    def open_() -> TorchStyleLoader:
        loader = open_loader(
            contender,
            our,
            settings,
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            state_every_batch=state,
            in_loop=measure == "state",
        )
        opened.append(loader)
        return loader

    if measure == "first_batch":
        return first_batch(open_, settings)
    if measure == "epoch":
        return whole_epoch(open_, settings, samples, batch_size, sample_bytes)
    result = throughput(open_, settings, samples, batch_size, sample_bytes)
    if state:  # the state was really taken: once per batch the loop received
        result["states_taken"] = opened[-1].states_taken
    return result


@dataclass(frozen=True)
class Bar:
    """A line of the table: mprs_plus against the best of ``against`` (by the metric's
    direction), the ratio oriented so that above 1 is better for mprs_plus, and the project's
    ``threshold`` on it, worded as ``target``; a threshold of None shows it for information."""

    against: tuple[str, ...]
    threshold: float | None
    target: str = "—"


def workloads(our: OurLoader, jpegs: list[str]) -> list[tuple[harness.Workload, tuple[Bar, ...]]]:
    """Every workload with its runners and its bar. ``jpegs`` are the JPEG workload's files."""
    rows_tensor = functools.cache(_rows_tensor)

    def runners(make: Make, batch_size: int, contenders: tuple[str, ...], **how: Any) -> dict[str, harness.Runner]:
        return {c: functools.partial(_run, c, our, make, batch_size, **how) for c in contenders}

    with_peers = (MPRS_PLUS, *PEERS)
    no_state = {TORCH: "torch's DataLoader has no state_dict()", SPDL: "SPDL's loader has no state_dict()"}
    return [
        (
            harness.Workload(
                name="ints",
                title="ints, batch 64",
                description="sample i is the int i; per-sample overhead of the loader itself",
                metrics=(SAMPLES,),
                runners=runners(_ints, 64, (*with_peers, TORCH_NO_WORKERS)),
            ),
            (Bar((TORCH,), 4.0, "≥ 4x DataLoader"), Bar((TORCH_NO_WORKERS,), 1.3, "≥ 1.3x no workers")),
        ),
        (
            harness.Workload(
                name="rows",
                title="in-memory rows, batch 128, shuffled",
                description="TensorDataset of float32 rows (32 features) and int64 labels, shuffled",
                metrics=(SAMPLES,),
                runners=runners(
                    lambda s: (rows_tensor(_rows(s)), _rows(s)), 128, (*with_peers, TORCH_NO_WORKERS), shuffle=True
                ),
            ),
            (Bar((TORCH,), 3.0, "≥ 3x DataLoader"), Bar((TORCH_NO_WORKERS,), 1.5, "≥ 1.5x no workers")),
        ),
        (
            harness.Workload(
                name="tensors_1mib",
                title="1 MiB tensors, batch 8",
                description="sample i is a fresh float32 tensor of 1 MiB; batches of 8 MiB; GB/s",
                metrics=(BANDWIDTH,),
                runners=runners(_tensors, 8, (*with_peers, TORCH_NO_WORKERS), sample_bytes=harness.MiB),
            ),
            (Bar((TORCH,), 2.0, "≥ 2x DataLoader"), Bar((TORCH_NO_WORKERS,), 0.6, "≥ 0.6x no workers")),
        ),
        (
            harness.Workload(
                name="cpu_2ms",
                title="2 ms Python per sample, batch 16",
                description="a pure-Python loop of about 2 ms per sample (GIL held) in the workers",
                metrics=(SAMPLES,),
                runners=runners(_cpu_work, 16, with_peers),
            ),
            (Bar(PEERS, 1.0, "≥ 1.0x the best of the three peers"),),
        ),
        (
            harness.Workload(
                name="jpeg",
                title="JPEG decoding (Pillow), batch 32",
                description=f"{len(jpegs)} generated 256x256 JPEGs decoded to uint8 HxWx3 tensors, cycled",
                metrics=(SAMPLES,),
                runners=runners(lambda s: _jpegs(s, jpegs), 32, with_peers),
            ),
            (Bar(PEERS, 1.0, "≥ 1.0x the best of the three peers"),),
        ),
        (
            harness.Workload(
                name="state_every_batch",
                title="state_dict() after every batch (ints, batch 64)",
                description="the ints workload with loader.state_dict() taken after every batch",
                metrics=(SAMPLES,),
                runners=runners(_ints, 64, (MPRS_PLUS, STATEFUL, MPRS_PLUS_NO_STATE), measure="state"),
                notes=no_state,
            ),
            (
                Bar((MPRS_PLUS_NO_STATE,), 0.9, "≥ 0.9x our own rate without it"),
                Bar((STATEFUL,), 4.0, "≥ 4x StatefulDataLoader's"),
            ),
        ),
        (
            harness.Workload(
                name="ints_epoch",
                title="whole epoch with start-up: 100k ints, batch 64",
                description="from building the loader to its last batch: a short epoch as a validation loop runs it",
                metrics=(SAMPLES,),
                runners=runners(_ints_epoch, 64, (*with_peers, TORCH_NO_WORKERS), measure="epoch"),
            ),
            (Bar((TORCH,), None), Bar((TORCH_NO_WORKERS,), None)),
        ),
        (
            harness.Workload(
                name="tensors_1mib_epoch",
                title="whole epoch with start-up: 1,600 x 1 MiB tensors, batch 8",
                description="from building the loader to its last batch; fresh float32 tensors of 1 MiB; GB/s",
                metrics=(BANDWIDTH,),
                runners=runners(
                    _tensors_epoch, 8, (*with_peers, TORCH_NO_WORKERS), sample_bytes=harness.MiB, measure="epoch"
                ),
            ),
            (Bar((TORCH,), None), Bar((TORCH_NO_WORKERS,), None)),
        ),
        (
            harness.Workload(
                name="first_batch",
                title="time to the first batch (ints, batch 64)",
                description="seconds from building the loader to holding its first batch",
                metrics=(FIRST_BATCH,),
                runners=runners(lambda s: (Ints(64 * 1_000), 64 * 1_000), 64, with_peers, measure="first_batch"),
            ),
            (Bar((TORCH,), 1.0, "no later than DataLoader's (≥ 1.0x)"),),
        ),
    ]


# Each dataset with its epoch length in samples: long enough that the time budget, not the
# epoch, ends a fast contender's measurement.


def _ints(settings: harness.Settings) -> tuple[Ints, int]:
    n = 64 * (4_000 if settings.quick else 40_000)
    return Ints(n), n


def _tensors(settings: harness.Settings) -> tuple[Made, int]:
    n = 8 * (100 if settings.quick else 1_000)
    return Made(n, functools.partial(torch_tensor, numel=harness.MiB // 4)), n


def _ints_epoch(settings: harness.Settings) -> tuple[Ints, int]:
    n = 20_000 if settings.quick else 100_000
    return Ints(n), n


def _tensors_epoch(settings: harness.Settings) -> tuple[Made, int]:
    n = 320 if settings.quick else 1_600
    return Made(n, functools.partial(torch_tensor, numel=harness.MiB // 4)), n


def _cpu_work(settings: harness.Settings) -> tuple[Made, int]:
    n = 16 * (40 if settings.quick else 400)
    return Made(n, functools.partial(burn, loops=settings.cpu_loops)), n


def _jpegs(settings: harness.Settings, paths: list[str]) -> tuple[Jpegs, int]:
    n = 32 * (30 if settings.quick else 300)
    return Jpegs(paths, n), n


def _rows(settings: harness.Settings) -> int:
    return 200_000 if settings.quick else 1_000_000


def _rows_tensor(n: int) -> torch.utils.data.TensorDataset:
    """Made once per run (128 MiB in the full run) and shared with forked workers."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(n, 32, generator=generator)
    labels = torch.randint(0, 10, (n,), generator=generator)
    return torch.utils.data.TensorDataset(features, labels)
