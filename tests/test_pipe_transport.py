"""The pipe transport (the one wherever the shared-memory rings are not used: macOS, Linux
on aarch64) keeps every promise the rings keep: every test that concerns the transport
runs again with ``MPRS_PLUS_TRANSPORT=pipe``, as part of the suite's own command.

The transport's tests (channels, lending, page locking, processes, portable paths), the
service end to end, stop, faults, stuck reads and ordering, checkpoints, worker errors,
release of memory and descriptors, zero copy and fork safety, statistics, start-up,
replacing dead workers,
pausing, batches collated straight into the lend area, and SharedList under the loaders. The tests that look inside the rings skip themselves there; the docs and the
tests of everything above the transport (planning, options, the Ray backend) run once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBSET = [
    "tests/transport",
    "tests/test_reading_service.py",
    "tests/test_stop.py",
    "tests/test_faults.py",
    "tests/test_stuck.py",
    "tests/test_order.py",
    "tests/test_checkpoint.py",
    "tests/test_checkpoint_integrity.py",
    "tests/test_worker_exceptions.py",
    "tests/test_release.py",
    "tests/test_zero_copy.py",
    "tests/test_fork_safety.py",
    "tests/test_stats.py",
    "tests/test_startup.py",
    "tests/test_lifecycle_state.py",
    "tests/test_run_ahead.py",
    "tests/test_pause.py",
    "tests/test_dataloader_in_place.py",
    "tests/test_worker_restarts.py",
    "tests/test_oom_kills.py",
    "tests/test_auto_workers.py",
    # seeding="batch" over the workers' channels: the same batches, a restore at another
    # count, a poison sample (the rest of that file runs in one process, or once is enough).
    "tests/test_elastic.py::test_the_same_batches_for_0_1_and_3_workers_and_as_ready",
    "tests/test_elastic.py::test_a_state_taken_at_2_workers_restores_at_3_0_and_1",
    "tests/test_elastic.py::test_a_poison_sample_leaves_every_other_batch_unchanged",
    # SharedList itself maps its block as the lend areas do on both transports; what the
    # transport carries is the list under our two loaders.
    "tests/test_shared_list.py::test_mprs_plus_dataloader_over_it",
    "tests/test_shared_list.py::test_the_reading_service_over_an_iterable_wrapper_of_it",
]
# Tests of those files whose subject lies above the transport, proved once on the rings and
# costly to prove again: two ranks' loaders composed with torchdata's distributed service
# (the file's resume cases still restore exact streams over the pipes).
ABOVE_THE_TRANSPORT = [
    "tests/test_checkpoint.py::test_each_rank_resumes_its_own_stream",
]


# About 2 minutes on two busy cores, with the ini's two workers; the bound leaves room.
@pytest.mark.timeout(900)
def test_everything_that_concerns_the_transport_passes_on_the_pipe_transport():
    env = dict(os.environ, MPRS_PLUS_TRANSPORT="pipe")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    script = "import mprs_plus.transport as t; assert t.TRANSPORT == 'pipe', t.TRANSPORT"
    subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, check=True, timeout=120)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUBSET]
        + [f"--deselect={test}" for test in ABOVE_THE_TRANSPORT],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=870,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
