"""benchmarks/gpu_feed.py runs where there is no GPU: its CPU smoke mode goes through the
mprs_plus contenders, the overlap case and the corruption check with tiny items, and a plain
run says in one line that it needs a CUDA device. Speed is never asserted; each run is a
subprocess with a timeout, so a hang fails the test instead of the session."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mprs_plus import MultiProcessingReadingService

ROOT = Path(__file__).resolve().parent.parent


def _run(*options: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_feed.py", *options],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.timeout(180)
def test_the_cpu_smoke_run_measures_and_checks_the_mprs_plus_contenders(tmp_path):
    done = _run("--check-cpu", "--out", str(tmp_path))
    (found,) = tmp_path.glob("gpu-feed-*-cpu.json")
    record = json.loads(found.read_text(encoding="utf-8"))
    assert not record.get("errors"), record["errors"]
    pinning = "pin_memory" in inspect.signature(MultiProcessingReadingService).parameters
    ran = {"mprs_plus", "mprs_plus+pin"} if pinning else {"mprs_plus"}
    for cells in record["throughput"].values():
        assert {c for c, values in cells.items() if values and c in ran} == ran
        assert all(value > 0 for values in cells.values() for value in values)
    checked = {f"{c}, whole tensors" for c in ran} | {
        f"{c}, {variant}" for c in ran - {"mprs_plus"} for variant in ("offset views", "4-128 KiB tensors")
    }
    assert set(record["check"]) == checked and all(found["passed"] for found in record["check"].values())
    assert record["skipped"] == []
    assert set(record["overlap"]["step_ms"]) == {"compute alone", *ran}
    assert "mprs_plus+device: not run" in done.stdout  # device= needs CUDA


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the benchmark would run")
def test_without_cuda_a_plain_run_says_so_in_one_line(tmp_path):
    done = _run("--out", str(tmp_path), timeout=60)
    assert done.stdout.strip().splitlines() == [done.stdout.strip()]
    assert "needs a CUDA device" in done.stdout
    assert not list(tmp_path.iterdir())


def test_each_figure_is_saved_as_measured_and_what_the_budget_leaves_out_is_named(tmp_path, monkeypatch):
    """A bounded caller (a device lent for minutes) keeps every figure measured before a
    cut-off: the run saves after each measurement, and skips, naming them, those that
    would not fit."""
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks import gpu_feed
    finally:
        sys.path.remove(str(ROOT))
    args = gpu_feed.build_parser().parse_args(["--check-cpu", "--out", str(tmp_path), "--budget", "0"])
    args.workers, args.repetitions, args.seconds = 1, 1, 0.1
    args.sizes, args.overlap_mib, args.check_mib, args.check_items = (0.25,), 0.25, 0.25, 4
    args.contenders = ("mprs_plus",)
    saved: list[int] = []
    record = gpu_feed.run(args, gpu_feed.Target(torch.device("cpu")), lambda r: saved.append(len(r["skipped"])))
    assert "mprs_plus 0.25 MiB rep 1" in record["skipped"] and "check mprs_plus, whole tensors" in record["skipped"]
    assert saved == sorted(saved) and saved[-1] == len(record["skipped"])  # saved as it went
    assert len(saved) >= len(record["skipped"])
    assert "skipped (the time budget ran out): mprs_plus 0.25 MiB rep 1" in gpu_feed.report(record)


def test_the_device_check_script_parses_and_names_its_calls(tmp_path):
    """The full dry run (wheels resolved for the device's Python, installed for this one,
    tests and report) takes minutes: ``bash benchmarks/gpu_device_check.sh dry-run``. Here:
    the script parses, and an unknown call is refused with the list of calls."""
    script = ROOT / "benchmarks" / "gpu_device_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=30).returncode == 0
    env = {**os.environ, "OUT": str(tmp_path)}
    done = subprocess.run(["bash", str(script), "nonsense"], capture_output=True, text=True, timeout=30, env=env)
    assert done.returncode == 2
    assert "tests|figures|all|wheels|dry-run" in done.stderr
