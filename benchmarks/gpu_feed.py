#!/usr/bin/env python
"""Feeding a GPU: bytes delivered to the device per second, against the bus's own limits.

    python benchmarks/gpu_feed.py                    8 workers, 2 repetitions, 4 and 32 MiB items
    python benchmarks/gpu_feed.py --workers 16 --seconds 4 --repetitions 3
    python benchmarks/gpu_feed.py --check            the corruption check only
    python benchmarks/gpu_feed.py --check-cpu        a smoke run on the CPU (no CUDA needed)

Workers make uint8 tensors of each size; the training loop moves each one to the GPU and
drops the host tensor. Contenders:

    mprs_plus          the loop does x.to("cuda", non_blocking=True) from pageable memory
    mprs_plus+pin      pin_memory=True: items arrive page-locked; the same .to(...) in the loop
    mprs_plus+device   pin_memory=True, device="cuda": items arrive on the GPU, copied ahead
    torch+pin          torch's DataLoader(pin_memory=True), the loop's .to(...)
    torch              torch's DataLoader, the loop's .to(...)
    torchdata          torchdata's MultiProcessingReadingService, the loop's .to(...)
    torchdata+pin      the same with .pin_memory() at the end of the pipeline

Every repetition measures every contender once per size, a different contender first each
time, and the host-to-GPU copy limits (one pinned and one pageable tensor of the item size,
copied again and again) in the same run. GB/s counts the bytes that reached the device:
the clock starts after a warm-up and stops after a synchronize. The overlap case gives each
32 MiB item a step of GPU work (a matrix product of a few milliseconds) and compares the
step time with data to the same steps without any.

The corruption check streams items whose every 4 bytes hold the item's index; the loop
enqueues each copy behind a GPU sleep on its stream (``torch.cuda._sleep``: the copy runs
late) and drops the host tensor at once, while the workers refill as fast as they can;
every item kept on the GPU is compared with its pattern at the end. It runs on whole
tensors, on views at an offset into them, and on 4-128 KiB tensors (pinned copies), and
once more with every release fence passed at once, which must find damage: that shows the
check can fail. A mismatch in the real runs makes the exit status 1; speed is reported,
never asserted. Each figure is written (JSON and Markdown) as soon as it is measured;
``--budget`` skips, and names, what would not fit in the time given.

Without CUDA it says so in one line and exits 0; ``--check-cpu`` then runs the mprs_plus
contenders, the overlap case and the corruption check on the CPU with tiny items, which
checks the machinery only.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import inspect
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Run as a script, this folder is first on sys.path; import the suite from the repository root.
if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
    sys.path[0] = str(ROOT)
elif str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

warnings.filterwarnings("ignore", message=r"\s*#+\s*WARNING!")
warnings.filterwarnings("ignore", message=r"This DataLoader will create \d+ worker processes")

import torch  # noqa: E402

from benchmarks import harness  # noqa: E402

MPRS = "mprs_plus"
MPRS_PIN = "mprs_plus+pin"
MPRS_DEVICE = "mprs_plus+device"
TORCH_PIN = "torch+pin"
TORCH = "torch"
TORCHDATA = "torchdata"
TORCHDATA_PIN = "torchdata+pin"
CONTENDERS = (MPRS, MPRS_PIN, MPRS_DEVICE, TORCH_PIN, TORCH, TORCHDATA, TORCHDATA_PIN)
OURS = (MPRS, MPRS_PIN, MPRS_DEVICE)
OVERLAP_CONTENDERS = (MPRS, MPRS_PIN, MPRS_DEVICE, TORCH_PIN)
COPY_PINNED, COPY_PAGEABLE = "copy limit, pinned", "copy limit, pageable"
SOURCE_ITEMS = 1 << 40  # far more than any measurement reads: the loop stops, not the source
MiB = 1 << 20


# -- what the workers make -------------------------------------------------------------------


def make_item(index: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` of uint8 whose every 4 bytes hold ``index``: what the corruption check expects."""
    return torch.full((nbytes // 4,), index, dtype=torch.int32).view(torch.uint8)


def intact(index: int, tensor: torch.Tensor, nbytes: int) -> bool:
    return tensor.numel() == nbytes and bool(tensor.view(torch.int32).eq(index).all())


class Make:
    """``(index, make_item(index, nbytes))``: a module-level callable, so any start method carries it."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __call__(self, index: int) -> tuple[int, torch.Tensor]:
        return index, make_item(index, self.nbytes)


class Items(torch.utils.data.Dataset):
    """The same items for torch's DataLoader."""

    def __init__(self, count: int, nbytes: int) -> None:
        self.count, self.make = count, Make(nbytes)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
        return self.make(index)


# -- contenders ------------------------------------------------------------------------------


def service_options() -> set[str]:
    from mprs_plus import MultiProcessingReadingService

    return set(inspect.signature(MultiProcessingReadingService).parameters)


def missing(contender: str, device: torch.device) -> str | None:
    """Why ``contender`` cannot run here, or None."""
    if contender in (MPRS_PIN, MPRS_DEVICE) and "pin_memory" not in service_options():
        return "MultiProcessingReadingService has no pin_memory option in this version"
    if contender == MPRS_DEVICE and "device" not in service_options():
        return "MultiProcessingReadingService has no device option in this version"
    if contender == MPRS_DEVICE and device.type != "cuda":
        return "device= moves items to a CUDA device"
    if contender in (TORCH_PIN, TORCHDATA_PIN) and device.type != "cuda":
        return "pinning needs a CUDA device"
    return None


def delivers_on_device(contender: str) -> bool:
    return contender == MPRS_DEVICE


def open_loader(
    contender: str, nbytes: int, count: int, settings: harness.Settings, device: torch.device, small: bool = False
) -> harness.Loader:
    workers, context = settings.num_workers, settings.context
    if contender in (TORCH, TORCH_PIN):
        loader = torch.utils.data.DataLoader(
            Items(count, nbytes),
            batch_size=None,
            num_workers=workers,
            multiprocessing_context=context,
            pin_memory=contender == TORCH_PIN,
        )
        return harness._TorchLoader(loader)
    from torchdata.dataloader2 import DataLoader2
    from torchdata.datapipes.iter import IterableWrapper

    pipe = IterableWrapper(range(count)).sharding_filter().map(MakeSmall() if small else Make(nbytes))
    if contender in OURS:
        from mprs_plus import MultiProcessingReadingService

        options: dict[str, Any] = {}
        if contender in (MPRS_PIN, MPRS_DEVICE):
            options["pin_memory"] = True
        if contender == MPRS_DEVICE:
            options["device"] = device
        service = MultiProcessingReadingService(workers, multiprocessing_context=context, **options)
    else:
        from torchdata.dataloader2 import MultiProcessingReadingService as TorchdataService

        if contender == TORCHDATA_PIN:
            pipe = pipe.pin_memory()  # non-replicable: runs in the main process, as users write it
        service = TorchdataService(workers, multiprocessing_context=context)
    data_loader = DataLoader2(pipe, reading_service=service)
    return harness.Loader(data_loader, data_loader.shutdown)


class Target:
    """Where items go: a CUDA device (a non-blocking copy; synchronize to see it done), or,
    for the CPU smoke run, a clone standing in for the copy."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def move(self, tensor: torch.Tensor, on_device: bool) -> torch.Tensor:
        if on_device:
            return tensor
        return tensor.to(self.device, non_blocking=True) if self.cuda else tensor.clone()

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


# -- measurements ----------------------------------------------------------------------------


def stream(
    contender: str, nbytes: int, settings: harness.Settings, target: Target, seconds: float, items: int | None
) -> dict[str, Any]:
    """GB/s delivered to the device in steady state, after a warm-up of a few items per worker."""
    on_device = delivers_on_device(contender)
    started = time.perf_counter()
    loader = open_loader(contender, nbytes, SOURCE_ITEMS, settings, target.device)
    problems = []
    try:
        iterator = iter(loader)
        first_item_s = None
        for _ in range(2 * settings.num_workers + 2):
            _, x = next(iterator)
            y = target.move(x, on_device)
            first_item_s = first_item_s or time.perf_counter() - started
            del x
        target.synchronize()
        count, start = 0, time.perf_counter()
        stop_at = start + seconds
        while items is None or count < items:
            _, x = next(iterator)
            y = target.move(x, on_device)
            del x  # the host tensor goes right after its copy is enqueued
            count += 1
            if time.perf_counter() >= stop_at:
                break
        target.synchronize()
        elapsed = time.perf_counter() - start
        del y
    finally:
        problem = harness.close_within(loader, settings)
        if problem:
            problems.append(problem)
    return {
        "gbps": count * nbytes / elapsed / harness.GB,
        "items": count,
        "seconds": elapsed,
        "first_item_s": first_item_s,
        "problems": problems,
    }


def copy_limit(nbytes: int, pinned: bool, target: Target, seconds: float) -> float:
    """GB/s of one host tensor copied to the device again and again (non-blocking), the
    clock read after a synchronize every few copies."""
    source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned and target.cuda)
    source.fill_(1)
    dest = torch.empty(nbytes, dtype=torch.uint8, device=target.device)
    dest.copy_(source, non_blocking=True)
    target.synchronize()
    copies, start = 0, time.perf_counter()
    while True:
        for _ in range(8):
            dest.copy_(source, non_blocking=True)
        copies += 8
        target.synchronize()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return copies * nbytes / elapsed / harness.GB


class Step:
    """A step of device work: one matrix product of ``size`` squared, a few milliseconds on a
    GPU, that reads one element of the item so that it depends on the data."""

    def __init__(self, size: int, target: Target) -> None:
        dtype = torch.float16 if target.cuda else torch.float32
        self.a = torch.randn(size, size, device=target.device, dtype=dtype)
        self.b = torch.randn(size, size, device=target.device, dtype=dtype)

    def __call__(self, item: torch.Tensor | None) -> torch.Tensor:
        out = self.a @ self.b
        if item is not None:
            out[0, :1] += item[:1].to(out.dtype)
        return out

    @classmethod
    def calibrated(cls, target: Target, milliseconds: float) -> Step:
        """The smallest of a few sizes whose product takes at least ``milliseconds``."""
        sizes = (1024, 2048, 4096, 6144, 8192, 12288, 16384) if target.cuda else (32, 64, 128)
        for size in sizes:
            step = cls(size, target)
            step(None)
            target.synchronize()
            start = time.perf_counter()
            for _ in range(5):
                step(None)
            target.synchronize()
            if (time.perf_counter() - start) / 5 * 1e3 >= milliseconds:
                break
        return step


def overlap(
    contender: str | None, step: Step, nbytes: int, settings: harness.Settings, target: Target, seconds: float
) -> dict[str, Any]:
    """Milliseconds per step, one item per step (or none, for ``contender`` None)."""
    loader = None if contender is None else open_loader(contender, nbytes, SOURCE_ITEMS, settings, target.device)
    on_device = contender is not None and delivers_on_device(contender)
    problems = []
    try:
        items: Iterator[Any] | None = None if loader is None else iter(loader)

        def one() -> None:
            data = None
            if items is not None:
                _, x = next(items)
                data = target.move(x, on_device)
                del x
            step(data)

        for _ in range(2 * settings.num_workers + 2):
            one()
        target.synchronize()
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            one()
            steps += 1
        target.synchronize()
        elapsed = time.perf_counter() - start
    finally:
        if loader is not None:
            problem = harness.close_within(loader, settings)
            if problem:
                problems.append(problem)
    return {"step_ms": elapsed / steps * 1e3, "steps": steps, "problems": problems}


CHECK_WHOLE, CHECK_OFFSET, CHECK_SMALL = "whole tensors", "offset views", "4-128 KiB tensors"
CHECK_VARIANTS = (CHECK_WHOLE, CHECK_OFFSET, CHECK_SMALL)
SMALL_SIZES = tuple(4096 << k for k in range(6))  # 4 KiB .. 128 KiB: under the lend threshold
OFFSET = 4096  # bytes the offset view starts after its item's start


class MakeSmall:
    """``(index, [tensors of 4 KiB .. 128 KiB])``, each with the index in every 4 bytes."""

    def __call__(self, index: int) -> tuple[int, list[torch.Tensor]]:
        return index, [make_item(index, nbytes) for nbytes in SMALL_SIZES]


@contextlib.contextmanager
def fences_off() -> Iterator[None]:
    """Every release fence of this process passes at once: what a missing fence would do.
    The corruption check must then fail, which shows that it can."""
    from mprs_plus.runtime.main import feeding

    original = feeding.CudaPageLocker.fence

    def passed_at_once(self: Any) -> Any:
        fence = feeding._Fence()
        fence.events = []
        return fence

    feeding.CudaPageLocker.fence = passed_at_once
    try:
        yield
    finally:
        feeding.CudaPageLocker.fence = original


def corruption_check(
    contender: str,
    nbytes: int,
    items: int,
    settings: harness.Settings,
    target: Target,
    variant: str = CHECK_WHOLE,
    delay_cycles: int = 0,
) -> dict[str, Any]:
    """Every item kept on the device, each host tensor dropped right after its copy was
    enqueued behind ``delay_cycles`` of GPU sleep on the loop's stream (the copy runs late,
    while the workers refill extents as fast as they can); then every kept item compared
    with the pattern its worker wrote. ``variant``: whole tensors, views at an offset into
    them (the copy reads from inside the buffer), or 4-128 KiB tensors (pinned copies)."""
    on_device = delivers_on_device(contender)
    loader = open_loader(contender, nbytes, items, settings, target.device, small=variant == CHECK_SMALL)
    kept: list[tuple[int, Any]] = []
    problems = []
    try:
        for index, x in loader:
            if delay_cycles and target.cuda:
                torch.cuda._sleep(delay_cycles)  # the copy below waits behind this on the loop's stream
            if variant == CHECK_SMALL:
                kept.append((index, [target.move(t, on_device) for t in x]))
            elif variant == CHECK_OFFSET:
                kept.append((index, target.move(x[OFFSET:], on_device)))
            else:
                kept.append((index, target.move(x, on_device)))
            del x  # its extent may be refilled at once: the copy must be done before that
    finally:
        problem = harness.close_within(loader, settings)
        if problem:
            problems.append(problem)
    target.synchronize()

    def whole(index: int, moved: Any) -> bool:
        if variant == CHECK_SMALL:
            return [t.numel() for t in moved] == list(SMALL_SIZES) and all(
                bool(t.view(torch.int32).eq(index).all()) for t in moved
            )
        if variant == CHECK_OFFSET:
            return moved.numel() == nbytes - OFFSET and bool(moved.view(torch.int32).eq(index).all())
        return intact(index, moved, nbytes)

    damaged = [index for index, moved in kept if not whole(index, moved)]
    indices = sorted(index for index, _ in kept)
    return {
        "items": len(kept),
        "complete": indices == list(range(items)),
        "damaged": damaged[:20],
        "damaged_count": len(damaged),
        "passed": not damaged and indices == list(range(items)),
        "problems": problems,
    }


# -- the run ---------------------------------------------------------------------------------


def guarded(
    what: str, limit_s: float, settings: harness.Settings, record: dict[str, Any], run: Callable[[], Any]
) -> Any:
    """``run()`` within a deadline; an error is recorded under ``what``, and every child
    process left behind is made to end."""
    try:
        with harness.deadline(limit_s, what):
            return run()
    except Exception as exc:
        record.setdefault("errors", []).append(f"{what}: {harness.describe(exc)}")
        return None
    finally:
        gc.collect()
        killed = harness.end_children(settings.reap_grace_s)
        if killed:
            record.setdefault("errors", []).append(f"{what}: processes left running after the shutdown: {killed}")


class Budget:
    """Seconds the run may still take: a measurement that would not fit is skipped and
    said so, so that a bounded caller (a device lent for minutes) gets every figure that
    fits rather than none."""

    def __init__(self, seconds: float | None) -> None:
        self.end = None if seconds is None else time.perf_counter() + seconds

    def allows(self, needed_s: float) -> bool:
        return self.end is None or time.perf_counter() + needed_s <= self.end


def run(args: argparse.Namespace, target: Target, save: Callable[[dict[str, Any]], None] = lambda record: None) -> dict[str, Any]:
    """Every measurement, most wanted first (throughput, the corruption checks, then the
    overlap); ``save(record)`` after each one, so that a run cut off keeps what it measured."""
    settings = harness.Settings(
        num_workers=args.workers,
        context=args.context,
        repetitions=args.repetitions,
        shutdown_limit_s=20.0,
        reap_grace_s=3.0,
    )
    sizes = [int(mib * MiB) for mib in args.sizes]
    contenders = [c for c in args.contenders if not missing(c, target.device)]
    limit_s = args.seconds * 4 + 90  # start-up, warm-up, timed streaming, shutdown
    budget = Budget(args.budget)
    expected_s = args.seconds + 12  # what one measurement usually takes: start, warm-up, stop
    record: dict[str, Any] = {
        "environment": {**harness.environment(settings), **device_environment(target)},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "not_run": {c: missing(c, target.device) for c in args.contenders if missing(c, target.device)},
        "throughput": {str(n): {c: [] for c in (*contenders, COPY_PINNED, COPY_PAGEABLE)} for n in sizes},
        "first_item_s": {c: [] for c in contenders},
        "overlap": {},
        "check": {},
        "skipped": [],
    }
    started = time.perf_counter()

    def measure(what: str, needed_s: float, limit: float, run_one: Callable[[], Any]) -> Any:
        if not budget.allows(needed_s):
            record["skipped"].append(what)
            save(record)
            return None
        found = guarded(what, limit, settings, record, run_one)
        record["wall_s"] = time.perf_counter() - started
        save(record)
        return found

    if not args.check:
        for rep in range(args.repetitions):
            shift = rep % len(contenders) if contenders else 0
            order = contenders[shift:] + contenders[:shift]
            for nbytes in sizes:
                cells = record["throughput"][str(nbytes)]
                for pinned, name in ((True, COPY_PINNED), (False, COPY_PAGEABLE)):
                    copy = functools.partial(copy_limit, nbytes, pinned, target, args.seconds / 2)
                    value = measure(name, args.seconds, limit_s, copy)
                    if value is not None:
                        cells[name].append(value)
                for contender in order:
                    what = f"{contender} {nbytes / MiB:g} MiB rep {rep + 1}"
                    one = functools.partial(stream, contender, nbytes, settings, target, args.seconds, args.items)
                    found = measure(what, expected_s, limit_s, one)
                    if found is not None:
                        cells[contender].append(found["gbps"])
                        record["first_item_s"][contender].append(found["first_item_s"])
                        record.setdefault("details", []).append({"what": what, **found})
                print(f"rep {rep + 1}/{args.repetitions}, {nbytes / MiB:g} MiB: done", file=sys.stderr, flush=True)
    if not args.no_check:
        nbytes = int(args.check_mib * MiB)
        delay = record["check_delay_cycles"] = 0 if not target.cuda else args.check_delay_cycles
        for variant in CHECK_VARIANTS:
            for contender in [c for c in OURS if c in contenders]:
                if variant != CHECK_WHOLE and contender == MPRS:
                    continue  # pageable copies are synchronous: nothing to check beyond whole tensors
                name = f"{contender}, {variant}"
                one = functools.partial(
                    corruption_check, contender, nbytes, args.check_items, settings, target, variant, delay
                )
                found = measure(f"check {name}", expected_s + 10, limit_s + 60, one)
                if found is not None:
                    record["check"][name] = found
                elif f"check {name}" not in record["skipped"]:
                    record["check"][name] = {"passed": False, "items": 0, "problems": ["it failed: see errors"]}
                    save(record)
        if target.cuda and MPRS_PIN in contenders:
            # The same check with every fence passed at once must find damage: it can fail.
            def without_fences() -> dict[str, Any]:
                with fences_off():
                    return corruption_check(MPRS_PIN, nbytes, args.check_items, settings, target, CHECK_WHOLE, delay)

            found = measure("check without fences", expected_s + 10, limit_s + 60, without_fences)
            if found is not None:
                record["check_power"] = found
                save(record)
    if not args.check and not args.no_overlap:
        record["overlap"] = run_overlap(args, settings, target, limit_s, record, measure, expected_s)
        save(record)
    record["wall_s"] = time.perf_counter() - started
    save(record)
    return record


def run_overlap(
    args: argparse.Namespace,
    settings: harness.Settings,
    target: Target,
    limit_s: float,
    record: dict[str, Any],
    measure: Callable[..., Any],
    expected_s: float,
) -> dict[str, Any]:
    nbytes = int(args.overlap_mib * MiB)
    step = Step.calibrated(target, args.step_ms)
    contenders = [c for c in OVERLAP_CONTENDERS if c in args.contenders and not missing(c, target.device)]
    found: dict[str, list[float]] = {"compute alone": [], **{c: [] for c in contenders}}
    over = record["overlap"] = {"item_bytes": nbytes, "matrix": step.a.shape[0], "step_ms": found}
    for rep in range(args.repetitions):
        shift = rep % (len(contenders) + 1)
        order = [None, *contenders][shift:] + [None, *contenders][:shift]
        for contender in order:
            name = contender or "compute alone"
            one = functools.partial(overlap, contender, step, nbytes, settings, target, args.seconds)
            result = measure(f"overlap {name}", expected_s, limit_s, one)
            if result is not None:
                found[name].append(result["step_ms"])
    return over


def device_environment(target: Target) -> dict[str, Any]:
    if not target.cuda:
        return {"device": "cpu (smoke run: the figures mean nothing)"}
    props = torch.cuda.get_device_properties(target.device)
    return {
        "device": torch.cuda.get_device_name(target.device),
        "device_memory_gib": round(props.total_memory / (1 << 30), 1),
        "cuda": torch.version.cuda,
    }


# -- the report ------------------------------------------------------------------------------


def spread(values: list[float], digits: int = 2) -> str:
    if not values:
        return "failed"
    low, high = min(values), max(values)
    low_text, high_text = f"{low:.{digits}f}", f"{high:.{digits}f}"
    return low_text if low_text == high_text else f"{low_text}–{high_text}"


def report(record: dict[str, Any]) -> str:
    env = record["environment"]
    lines = [
        f"# Feeding a GPU ({env['device']})",
        "",
        f"{env['num_workers']} workers ({env['start_method']}), Python {env['python']}, "
        f"torch {env['versions']['torch']}, "
        f"torchdata {env['versions']['torchdata']}, {env['logical_cores']} cores, "
        f"{record['settings']['repetitions']} interleaved repetitions of {record['settings']['seconds']:g} s.",
        "",
    ]
    if record["throughput"] and any(any(v for v in cells.values()) for cells in record["throughput"].values()):
        columns = list(next(iter(record["throughput"].values())))
        lines += ["GB/s delivered to the device (lowest–highest of the repetitions):", ""]
        lines += ["| item | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
        for nbytes, cells in record["throughput"].items():
            lines.append(f"| {int(nbytes) / MiB:g} MiB | " + " | ".join(spread(cells[c]) for c in columns) + " |")
        lines.append("")
        for nbytes, cells in record["throughput"].items():
            limit = statistics.median(cells[COPY_PINNED]) if cells.get(COPY_PINNED) else None
            ratios = [
                f"{c} {statistics.median(v) / limit:.2f}x"
                for c, v in cells.items()
                if v and limit and c not in (COPY_PINNED, COPY_PAGEABLE)
            ]
            if ratios:
                lines.append(
                    f"- {int(nbytes) / MiB:g} MiB, as a share of the pinned copy limit ({limit:.1f} GB/s, median): "
                    + ", ".join(ratios)
                )
        lines.append("")
    firsts = {c: v for c, v in record.get("first_item_s", {}).items() if v}
    if firsts:
        lines.append(
            "First item (seconds from making the loader to the first item on the device, median): "
            + ", ".join(f"{c} {statistics.median(v):.2f}" for c, v in firsts.items())
        )
        lines.append("")
    if record["overlap"]:
        over = record["overlap"]
        alone = statistics.median(over["step_ms"]["compute alone"]) if over["step_ms"]["compute alone"] else None
        lines += [
            f"Overlap: a {over['matrix']}-square matrix product per {over['item_bytes'] / MiB:g} MiB item, ms per step "
            "(median; with data / compute alone):",
            "",
        ]
        for name, values in over["step_ms"].items():
            compared = values and alone and name != "compute alone"
            ratio = f" ({statistics.median(values) / alone:.2f}x)" if compared else ""
            lines.append(f"- {name}: {statistics.median(values):.2f}{ratio}" if values else f"- {name}: failed")
        lines.append("")
    if record["check"]:
        delay = record.get("check_delay_cycles", 0)
        lines += [
            f"Corruption check (each copy enqueued behind {delay} cycles of GPU sleep on the loop's stream, "
            "the host tensor dropped at once):",
            "",
        ]
        for name, found in record["check"].items():
            verdict = "passed" if found.get("passed") else "FAILED"
            count = found.get("damaged_count")
            damaged = f", damaged: {count} (first {found['damaged']})" if count else ""
            lines.append(f"- {name}: {verdict}, {found.get('items', 0)} items{damaged}")
        power = record.get("check_power")
        if power is not None:
            count = power.get("damaged_count", 0)
            verdict = (
                f"{count} of {power.get('items', 0)} items damaged: the check can fail"
                if count
                else "no damage found: on this run the check could not tell a missing fence"
            )
            lines.append(f"- {MPRS_PIN} with every fence passed at once: {verdict}")
        lines.append("")
    for contender, why in record["not_run"].items():
        lines.append(f"- {contender}: not run ({why})")
    for what in record.get("skipped", []):
        lines.append(f"- skipped (the time budget ran out): {what}")
    for error in record.get("errors", []):
        lines.append(f"- error: {error}")
    return "\n".join(lines).rstrip() + "\n"


def write(record: dict[str, Any], text: str, out: Path, name: str) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{name}.json", "markdown": out / f"{name}.md"}
    for path, content in ((paths["json"], json.dumps(record, indent=2, default=str) + "\n"), (paths["markdown"], text)):
        partial = path.with_suffix(path.suffix + ".partial")
        partial.write_text(content, encoding="utf-8")
        partial.replace(path)  # whole or the previous one: never half a file
    return paths


# -- entry point -----------------------------------------------------------------------------


def _contenders(text: str) -> tuple[str, ...]:
    wanted = {part.strip() for part in text.split(",") if part.strip()}
    unknown = sorted(wanted - set(CONTENDERS))
    if unknown or not wanted:
        raise argparse.ArgumentTypeError(f"unknown contender(s) {unknown}; choose from {', '.join(CONTENDERS)}")
    return tuple(c for c in CONTENDERS if c in wanted)


def _sizes(text: str) -> tuple[float, ...]:
    sizes = tuple(float(part) for part in text.split(",") if part.strip())
    if not sizes or min(sizes) <= 0:
        raise argparse.ArgumentTypeError("sizes are positive numbers of MiB")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="benchmarks/gpu_feed.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=8, help="worker processes of every loader (default 8)")
    parser.add_argument("--seconds", type=float, default=2.0, help="timed streaming per measurement (default 2)")
    parser.add_argument("--items", type=int, default=None, help="at most this many timed items per measurement")
    parser.add_argument("--repetitions", type=int, default=2, help="interleaved repetitions (default 2)")
    parser.add_argument(
        "--sizes", type=_sizes, default=(4.0, 32.0), metavar="MIB[,MIB...]", help="item sizes (default 4,32)"
    )
    parser.add_argument(
        "--contenders", type=_contenders, default=CONTENDERS, metavar="NAMES", help=f"from: {', '.join(CONTENDERS)}"
    )
    parser.add_argument("--context", default="fork", help="start method of every loader (default fork)")
    parser.add_argument("--overlap-mib", type=float, default=32.0, help="item size of the overlap case (default 32)")
    parser.add_argument("--step-ms", type=float, default=4.0, help="GPU work per step in the overlap case (default 4)")
    parser.add_argument("--no-overlap", action="store_true", help="leave the overlap case out")
    parser.add_argument("--check", action="store_true", help="run the corruption check only")
    parser.add_argument("--no-check", action="store_true", help="leave the corruption check out")
    parser.add_argument("--check-mib", type=float, default=4.0, help="item size of the corruption check (default 4)")
    parser.add_argument(
        "--check-items", type=int, default=512, help="items of the corruption check, all kept on the device (default 512)",
    )
    parser.add_argument(
        "--check-delay-cycles",
        type=int,
        default=2_000_000,
        help="GPU sleep before each checked copy, in cycles (default 2e6, about 1 ms)",
    )
    parser.add_argument("--budget", type=float, default=None, help="seconds the run may take: what would not fit is skipped")
    parser.add_argument("--check-cpu", action="store_true", help="smoke run on the CPU: mprs_plus contenders, tiny items")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="output folder (default benchmarks/results)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.workers < 1 or args.repetitions < 1:
        parser.error("--workers and --repetitions must be at least 1")
    if args.check and args.no_check:
        parser.error("--check and --no-check exclude each other")
    if args.check_cpu:
        # Tiny items (above and below nothing in particular: the lend threshold is 128 KiB),
        # a short budget: the machinery runs, the figures mean nothing.
        args.workers, args.repetitions, args.seconds = min(args.workers, 2), 1, min(args.seconds, 0.3)
        args.sizes, args.overlap_mib, args.check_mib, args.check_items = (0.25, 1.0), 0.25, 0.25, 32
        args.contenders = tuple(c for c in args.contenders if c in OURS)
        torch.set_num_threads(1)  # the loop's clones stand in for copies: one thread, no waits on busy cores
        target = Target(torch.device("cpu"))
    elif not torch.cuda.is_available():
        print("gpu_feed: needs a CUDA device (torch.cuda.is_available() is False); nothing measured. "
              "--check-cpu runs a smoke test on the CPU.")
        return 0
    else:
        target = Target(torch.device("cuda", torch.cuda.current_device()))
    name = f"gpu-feed-{datetime.now():%Y%m%d-%H%M%S}{'-cpu' if args.check_cpu else ''}"

    def save(record: dict[str, Any]) -> None:  # after every measurement: a cut-off keeps what was measured
        write(record, report(record), args.out, name)

    record = run(args, target, save)
    text = report(record)
    print(text)
    for kind, path in write(record, text, args.out, name).items():
        print(f"{kind:>8}: {path}")
    failed = [c for c, found in record["check"].items() if not found.get("passed")]
    if failed:
        print(f"gpu_feed: the corruption check FAILED for {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
