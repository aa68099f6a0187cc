"""A run of the suite adds nothing under the temporary directory.

What used to stay behind after every run: a folder per ``tempfile.mkdtemp()`` of the
checkpoint page's example, and Ray's session folders (logs and sockets, megabytes) of
every Ray the suite starts. This runs exactly those tests, in a pytest of their own whose
temporary directory (``TMPDIR``) is a fresh, empty folder, and looks at it afterwards.
pytest's own folders for ``tmp_path`` go elsewhere (``--basetemp``, which pytest empties
itself), so that what is left can only be the tests' own.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The tests that left something behind, each starting what did: the checkpoint page's
# example, and a Ray started and stopped by the service (address=None).
LEFT_THINGS = ["tests/test_docs.py::test_examples_run[docs/checkpoint.md]"]
if importlib.util.find_spec("ray") is not None:
    LEFT_THINGS.append("tests/test_ray_backend.py::test_ray_started_for_the_service_is_stopped_once_its_warm_actors_are_done")


@pytest.mark.timeout(360)
def test_the_tests_that_used_to_leave_folders_behind_leave_nothing(tmp_path):
    fresh = tempfile.mkdtemp(prefix="mprs-tmp-")  # short: Ray's socket paths live under it
    try:
        env = {
            **os.environ,
            "TMPDIR": fresh,
            "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
        }
        env.pop("RAY_TMPDIR", None)  # the run's own choice, as in a fresh shell
        done = subprocess.run(
            [sys.executable, "-m", "pytest", *LEFT_THINGS, "-n", "0", "-q", "-p", "no:cacheprovider",
             "--basetemp", str(tmp_path / "basetemp")],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=330,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert f"{len(LEFT_THINGS)} passed" in done.stdout, done.stdout[-3000:]
        left = sorted(os.path.relpath(os.path.join(folder, name), fresh)
                      for folder, folders, files in os.walk(fresh) for name in folders + files)
        assert left == [], f"left under the temporary directory: {left[:20]}"
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
