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
    assert set(record["check"]) == ran and all(record["check"][c]["passed"] for c in ran)
    assert set(record["overlap"]["step_ms"]) == {"compute alone", *ran}
    assert "mprs_plus+device: not run" in done.stdout  # device= needs CUDA


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the benchmark would run")
def test_without_cuda_a_plain_run_says_so_in_one_line(tmp_path):
    done = _run("--out", str(tmp_path), timeout=60)
    assert done.stdout.strip().splitlines() == [done.stdout.strip()]
    assert "needs a CUDA device" in done.stdout
    assert not list(tmp_path.iterdir())
