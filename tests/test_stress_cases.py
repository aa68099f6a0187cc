"""The adversarial cases of ``benchmarks/stress.py`` run once each, so that the script and
the promises it checks stay working (its long repetitions are run by hand)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "stress.py"


def test_the_adversarial_stress_cases_pass_once_under_fork():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--runs", "1", "--contexts", "fork", "--pipelines", "raises,checkpoints,runahead"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "0 failures" in done.stdout and "FAILED" not in done.stdout
