"""Shared fixtures: a start-method matrix and a leak check around every test.

The leak check fails a test that leaves a child process of this interpreter or a
shared-memory segment of the service behind. It waits a bounded time for children
that are already exiting; it never sleeps to synchronise.
"""

from __future__ import annotations

import os
import sys
import warnings

import psutil
import pytest

SHM_DIR = "/dev/shm"
SHM_PREFIX = "mprs_"
START_METHODS = ("fork", "spawn", "forkserver")


def _shm_segments() -> set[str]:
    try:
        return {name for name in os.listdir(SHM_DIR) if name.startswith(SHM_PREFIX)}
    except FileNotFoundError:
        return set()


def _is_ray(command: str) -> bool:
    """A process of a Ray cluster a test module started (its own daemons, its pool of idle
    workers): Ray owns them; the Ray tests check by Ray's state that no actor is left."""
    return command.startswith("ray::") or "/ray/" in command or "raylet" in command or "gcs_server" in command


def _service_children() -> list[psutil.Process]:
    # The forkserver itself (and multiprocessing's resource tracker) live for the whole
    # session by design; the service's own processes are named "mprs_plus ...".
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "forkserver" in " ".join(child.cmdline()) or "resource_tracker" in " ".join(child.cmdline()):
                continue
            if "ray" in sys.modules and _is_ray(" ".join(child.cmdline())):
                continue
            found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


@pytest.fixture(autouse=True)
def no_leaks():
    children_before = {p.pid for p in _service_children()}
    shm_before = _shm_segments()
    yield
    new = [p for p in _service_children() if p.pid not in children_before]
    _, alive = psutil.wait_procs(new, timeout=10)
    leaked_shm = _shm_segments() - shm_before
    for process in alive:
        process.kill()
    assert not alive, f"child processes left behind: {[p.pid for p in alive]}"
    assert not leaked_shm, f"shared-memory segments left behind: {sorted(leaked_shm)}"


@pytest.fixture(params=START_METHODS)
def start_method(request):
    return request.param


@pytest.fixture(autouse=True)
def _quiet_torchdata_deprecation():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"\s*#+\s*WARNING!")
        yield
