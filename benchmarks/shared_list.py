#!/usr/bin/env python
"""``SharedList`` against the list of Python objects it replaces, and against numpy columns.

    python benchmarks/shared_list.py                 1.5M records {path, label, box}, 2 workers
    python benchmarks/shared_list.py --records 300000 --workers 4
    python benchmarks/shared_list.py --quick         a smoke run of every case: 5,000 records,
                                                     1 worker, in this interpreter

Figures, each case in a fresh interpreter (so that one case's memory is not the next one's):

    build       SharedList(records): items/s
    read        s[i] at random i against list[i]: items/s of each (a SharedList unpickles a
                fresh copy per access; a list hands out the object)
    memory      the block against the records as Python objects (the main process's
                resident growth while it built them)
    epoch       one shuffled epoch of mprs_plus.DataLoader (fork, default collate) over the
                records as a list, a SharedList, and numpy columns: samples/s, and the
                workers' private memory growth since they started (their USS at the epoch's
                end, psutil, against their own first sample), as a share of the records' size
    first batch time from iter(loader) to the first batch under spawn, list against
                SharedList, and under fork for reference; and under spawn over 1,000 records,
                what a spawned worker costs whatever its dataset (an interpreter, torch)

The bar (issue): growth <= 0.1x with SharedList against >= 1x with a list; spawn's first
batch within 1.5x of fork's; reading at least half a list's rate. A report, not a test:
nothing is asserted. Ratios measured side by side in one run are what to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MIB = 2**20


def make_records(n: int) -> list[dict]:
    return [{"path": f"/data/images/{i:08d}.jpg", "label": i % 1000, "box": (i % 640, i % 480, 32, 32)} for i in range(n)]


class Columns:
    """The same records as numpy columns: the paths in one bytes blob with offsets, labels
    and boxes as arrays (what detectron2 does by hand)."""

    def __init__(self, records: list[dict]) -> None:
        import numpy as np

        paths = [r["path"].encode() for r in records]
        self.blob = np.frombuffer(b"".join(paths), dtype=np.uint8)
        self.ends = np.cumsum([len(p) for p in paths], dtype=np.int64)
        self.labels = np.array([r["label"] for r in records], dtype=np.int64)
        self.boxes = np.array([r["box"] for r in records], dtype=np.int32)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        start = int(self.ends[i - 1]) if i else 0
        path = self.blob[start : int(self.ends[i])].tobytes().decode()
        return {"path": path, "label": int(self.labels[i]), "box": tuple(int(v) for v in self.boxes[i])}


def _resident() -> int:
    from mprs_plus.runtime.private_memory import resident

    return resident()


def _dataset(kind: str, n: int) -> tuple[object, int]:
    """The dataset of ``kind`` and the records' size as Python objects (resident growth)."""
    import gc

    before = _resident()
    records = make_records(n)
    size = _resident() - before
    if kind == "list":
        return records, size
    if kind == "shared":
        from mprs_plus import SharedList

        shared = SharedList(records)
    else:
        shared = Columns(records)
    del records
    gc.collect()
    return shared, size


def case_costs(n: int) -> dict:
    from mprs_plus import SharedList

    before = _resident()
    records = make_records(n)
    objects = _resident() - before
    started = time.perf_counter()
    shared = SharedList(records)
    build = time.perf_counter() - started
    reads = min(n, 200_000)
    order = [random.randrange(n) for _ in range(reads)]
    rates = {}
    for name, source in (("list", records), ("shared", shared), ("list ", records), ("shared ", shared)):
        started = time.perf_counter()
        for i in order:
            source[i]
        rates[name.strip()] = max(rates.get(name.strip(), 0.0), reads / (time.perf_counter() - started))
    return {
        "build_items_per_s": n / build,
        "read_items_per_s": rates["shared"],
        "list_read_items_per_s": rates["list"],
        "block_bytes": shared.nbytes,
        "objects_bytes": objects,
    }


def _loader(dataset: object, workers: int, context: str):
    from mprs_plus import DataLoader

    return DataLoader(
        dataset, batch_size=256, shuffle=True, num_workers=workers, multiprocessing_context=context,
        persistent_workers=True,
    )


def case_epoch(kind: str, n: int, workers: int) -> dict:
    import psutil

    dataset, size = _dataset(kind, n)
    loader = _loader(dataset, workers, "fork")
    started = time.perf_counter()
    samples = 0
    for batch in loader:
        samples += len(batch["label"])
    seconds = time.perf_counter() - started
    stats = loader.stats()
    growth = 0
    for p in stats.processes:
        if p.role == "worker":
            start = p.private_bytes - p.private_growth_bytes  # its first sample, as its lane started
            growth += psutil.Process(p.pid).memory_full_info().uss - start
    del loader
    return {"samples_per_s": samples / seconds, "growth_bytes": growth, "records_bytes": size}


def case_first_batch(kind: str, n: int, workers: int, context: str) -> dict:
    dataset, _ = _dataset(kind, n)
    loader = _loader(dataset, workers, context)
    started = time.perf_counter()
    next(iter(loader))
    first = time.perf_counter() - started
    del loader
    return {"first_batch_s": first}


def _case(*args: str) -> dict:
    name, *rest = args
    if name == "costs":
        return case_costs(int(rest[0]))
    if name == "epoch":
        return case_epoch(rest[0], int(rest[1]), int(rest[2]))
    return case_first_batch(rest[0], int(rest[1]), int(rest[2]), rest[3])


def _run_case(*args: str, fresh: bool = True) -> dict:
    """One case in a fresh interpreter (``fresh``), or in this one (a smoke run)."""
    if not fresh:
        return _case(*args)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, __file__, "--case", *args], capture_output=True, text=True, env=env, timeout=1800
    )
    if done.returncode != 0:
        raise RuntimeError(f"case {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_500_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a smoke run of every case, in this interpreter")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--case", nargs="+", help=argparse.SUPPRESS)  # one case, in this fresh interpreter
    options = parser.parse_args()
    if options.case:
        print(json.dumps(_case(*options.case)))
        return
    n = 5_000 if options.quick else options.records
    workers = 1 if options.quick else options.workers
    fresh, w = not options.quick, str(workers)
    figures: dict = {"records": n, "workers": workers, "costs": _run_case("costs", str(n), fresh=fresh)}
    figures["epoch"] = {kind: _run_case("epoch", kind, str(n), w, fresh=fresh) for kind in ("list", "shared", "columns")}
    # A list of 1,000 records under spawn: what a spawned worker costs whatever its dataset
    # (an interpreter, torch's import), against which the dataset's own part shows.
    cases = [("list", "fork"), ("shared", "fork"), ("list", "spawn"), ("shared", "spawn"), ("small", "spawn")]
    figures["first_batch"] = {
        f"{kind} {context}": _run_case(
            "first", "list" if kind == "small" else kind, str(1000 if kind == "small" else n), w, context, fresh=fresh
        )["first_batch_s"]
        for kind, context in cases
    }
    print(render(figures))
    if options.json is not None:
        options.json.write_text(json.dumps(figures, indent=2))


def render(f: dict) -> str:
    c, e, first = f["costs"], f["epoch"], f["first_batch"]
    lines = [
        f"SharedList, {f['records']:,} records {{path, label, box}}, {f['workers']} worker{'s' if f['workers'] != 1 else ''}",
        f"  build: {c['build_items_per_s']:,.0f} items/s",
        f"  read (random s[i]): {c['read_items_per_s']:,.0f} items/s against a list's {c['list_read_items_per_s']:,.0f}"
        f" ({c['read_items_per_s'] / c['list_read_items_per_s']:.2f}x)",
        f"  memory: block {c['block_bytes'] / MIB:,.0f} MiB against {c['objects_bytes'] / MIB:,.0f} MiB of Python objects"
        f" ({c['block_bytes'] / max(c['objects_bytes'], 1):.2f}x)",
        "  one shuffled epoch, fork, default collate:",
    ]
    for kind, r in e.items():
        lines.append(
            f"    {kind:<8} {r['samples_per_s']:>10,.0f} samples/s   workers' private growth "
            f"{r['growth_bytes'] / MIB:>7,.0f} MiB = {r['growth_bytes'] / max(r['records_bytes'], 1):.2f}x the records"
        )
    lines.append("  first batch: " + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in first.items()))
    lines.append(
        f"  spawn/fork first batch: SharedList {first['shared spawn'] / first['shared fork']:.2f}x, "
        f"list {first['list spawn'] / first['list fork']:.2f}x; beyond a spawn over 1,000 records: SharedList "
        f"{first['shared spawn'] - first['small spawn']:+.2f} s, list {first['list spawn'] - first['small spawn']:+.2f} s"
    )
    list_rate = e["list"]["samples_per_s"]
    lines.append(
        f"  loader samples/s against the list's: SharedList {e['shared']['samples_per_s'] / list_rate:.2f}x, "
        f"columns {e['columns']['samples_per_s'] / list_rate:.2f}x"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
