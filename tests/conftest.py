"""Shared fixtures: a start-method matrix and a leak check around every test.

The leak check fails a test that leaves a child process of this interpreter or a
shared-memory segment of the service behind. It waits a bounded time for children
that are already exiting; it never sleeps to synchronise.

A hang that pytest-timeout cannot end ends the run: its timer is a signal, handled only
when the main thread runs Python again, and a call into native code (Ray's client, a
driver library) that waits forever never does. A watchdog thread of the interpreter's
own (``faulthandler``) then prints every thread's stack and exits, so that a stuck test
costs minutes and says where it stood instead of holding the run until its limit.
"""

from __future__ import annotations

import compileall
import faulthandler
import multiprocessing
import os
import sys
import warnings

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHM_DIR = "/dev/shm"
SHM_PREFIX = "mprs_"
START_METHODS = ("fork", "spawn", "forkserver")


def _shm_segments() -> set[str]:
    try:
        return {name for name in os.listdir(SHM_DIR) if name.startswith(SHM_PREFIX)}
    except FileNotFoundError:
        return set()


def _is_ray_daemon(process: psutil.Process) -> bool:
    """A daemon of a Ray cluster that a test module started (its control store, raylets,
    monitors): a direct child of this interpreter, started long before any test looks, so
    its command line is settled. Everything under it (Ray's workers and agents) is Ray's:
    the Ray tests check by Ray's state that no actor is left."""
    if "ray" not in sys.modules:
        return False
    command = " ".join(process.cmdline())
    return "raylet" in command or "gcs_server" in command or "/ray/" in command


def _service_children() -> list[psutil.Process]:
    """This interpreter's descendants but the long-lived helpers and Ray's trees.

    A Ray tree is left out by its root, never by a look at each of its processes: a worker
    Ray is starting or ending can show an empty command line, and a leak check that took it
    for ours would kill a process of the cluster under the next test."""
    # The forkserver itself (and multiprocessing's resource tracker) live for the whole
    # session by design; the service's own processes are named "mprs_plus ...".
    found = []
    for child in psutil.Process().children():
        try:
            command = " ".join(child.cmdline())
            if _is_ray_daemon(child):
                continue
            if "forkserver" not in command and "resource_tracker" not in command:
                found.append(child)
            found.extend(child.children(recursive=True))  # a forkserver's children are ours
        except psutil.NoSuchProcess:
            continue
    return found


def _described(process: psutil.Process) -> str:
    try:
        return f"{process.pid} ({' '.join(process.cmdline())[-120:]})"
    except psutil.Error:
        return f"{process.pid} (gone)"


def unstopped_services() -> str:
    """What still holds a service that was never stopped, for a leak's message: its stop
    runs when the last reference goes, so a leak with such a service names its holders
    (a few links up) rather than leaving a flake to guess at. Empty where there is none."""
    service = sys.modules.get("mprs_plus.runtime.main.service")
    if service is None:
        return ""
    import gc

    objects = gc.get_objects()
    found = [obj for obj in objects if type(obj) is service.ServiceRuntime and not obj.lifecycle.closed]
    del objects
    lines, here = [], sys._getframe()
    try:
        for index in range(min(3, len(found))):
            names, current, ours = ["ServiceRuntime"], found[index], [found, here]
            for _ in range(6):
                holders = [h for h in gc.get_referrers(current) if h is not ours and all(h is not mine for mine in ours)]
                if not holders:
                    break
                ours += [current, holders]
                current = holders[0]
                code = getattr(current, "f_code", None)
                names.append(type(current).__name__ + (f" {code.co_name}" if code is not None else ""))
            lines.append(" <- ".join(names))
    finally:
        found.clear()  # nothing of this look keeps a service alive
        ours = holders = current = None
    return f"; services never stopped, held by: {lines}" if lines else ""


@pytest.fixture(autouse=True)
def no_leaks():
    children_before = {p.pid for p in _service_children()}
    shm_before = _shm_segments()
    yield
    new = [p for p in _service_children() if p.pid not in children_before]
    _, alive = psutil.wait_procs(new, timeout=10)
    leaked_shm = _shm_segments() - shm_before
    left = [_described(process) for process in alive]
    for process in alive:
        process.kill()
    assert not alive, f"child processes left behind: {left}{unstopped_services()}"
    assert not leaked_shm, f"shared-memory segments left behind: {sorted(leaked_shm)}"


# Seconds past a test's own timeout before the watchdog ends the run: room for
# pytest-timeout to fail the test and for its teardown to run.
HARD_STOP_MARGIN = 90.0


def _timeout_of(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    if marker is not None and "timeout" in marker.kwargs:
        return float(marker.kwargs["timeout"])
    return float(item.config.getini("timeout") or 0)


_stderr: list = []  # this run's own stderr, copied while no test's output is captured


def pytest_sessionstart(session):
    """Write this checkout's bytecode once, as pip does for an installed package. The
    suite starts hundreds of fresh interpreters (spawned children, scripts, the docs'
    examples); where PYTHONDONTWRITEBYTECODE is set, each of them would otherwise compile
    the package and the test helpers from source, about 0.3 s of CPU apiece here."""
    for folder in ("mprs_plus", "tests", "benchmarks"):
        compileall.compile_dir(os.path.join(ROOT, folder), quiet=1)
    # The forkserver starts with torch already imported, as a user who starts many
    # loaders would set it up. Its children still unpickle their segment (what the
    # forkserver cases are there for) but no longer import torch each, the larger part of
    # a child's start here. Spawn's cases keep a child that imports everything itself.
    multiprocessing.set_forkserver_preload(["__main__", "torch", "torchdata.datapipes.iter"])


def pytest_unconfigure(config):
    while _stderr:
        _stderr.pop().close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    timeout = _timeout_of(item)
    if timeout > 0:
        if not _stderr:
            _stderr.append(os.fdopen(os.dup(2), "w"))
        faulthandler.dump_traceback_later(timeout + HARD_STOP_MARGIN, exit=True, file=_stderr[0])
    try:
        yield
    finally:
        if timeout > 0:
            faulthandler.cancel_dump_traceback_later()


@pytest.fixture(params=START_METHODS)
def start_method(request):
    return request.param


SHORT_STOP_GRACE = 1.0


@pytest.fixture
def short_stop_grace(monkeypatch):
    """A stop grace of ``SHORT_STOP_GRACE`` instead of ``STOP_GRACE`` (5 s), for a test
    whose children cannot exit on their own (stopped, or blocked in a DataPipe) and which
    checks what happens before or after the stop, not the grace itself: the stop then
    waits 1 s before it terminates them, instead of 5."""
    from mprs_plus.runtime.main import lifecycle

    monkeypatch.setattr(lifecycle, "STOP_GRACE", SHORT_STOP_GRACE)
    return SHORT_STOP_GRACE


@pytest.fixture(autouse=True)
def _quiet_torchdata_deprecation():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"\s*#+\s*WARNING!")
        yield


@pytest.fixture(scope="session", autouse=True)
def _ray_sessions_removed():
    """Ray keeps a session folder (logs, sockets: megabytes) for every cluster it starts,
    under ``RAY_TMPDIR`` or else the temporary directory, and never removes it. Every Ray
    this run starts (the test clusters, drivers in subprocesses, the benchmarks) writes into
    one folder of the run's own instead, removed when the run ends."""
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="mprs-ray-")  # short: Ray's socket paths must fit in 107 bytes
    previous = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = folder
    try:
        yield folder
    finally:
        if previous is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = previous
        shutil.rmtree(folder, ignore_errors=True)
