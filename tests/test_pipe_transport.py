"""The pipe transport (the fallback wherever the shared-memory rings are not used) is kept
working: a representative part of the suite runs again with ``MPRS_PLUS_TRANSPORT=pipe``.

The channel contract, payloads, ``send(timeout)``/``skip`` and the service end to end; the
tests that look inside the rings skip themselves there."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBSET = [
    "tests/transport/test_transport_channel.py",
    "tests/transport/test_transport_payloads.py",
    "tests/transport/test_transport_try_send_and_skip.py",
    "tests/test_reading_service.py",
]


@pytest.mark.timeout(420)
def test_a_representative_subset_passes_on_the_pipe_transport():
    env = dict(os.environ, MPRS_PLUS_TRANSPORT="pipe")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    script = "import mprs_plus.transport as t; assert t.TRANSPORT == 'pipe', t.TRANSPORT"
    subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, check=True, timeout=120)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "60", *SUBSET],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
