"""Large tensors stream where ``/dev/shm`` is tiny, as in a container: the rings are memfd.

Docker gives a container 64 MiB of ``/dev/shm`` unless told otherwise. Here a mount
namespace (``unshare -m``) gets a 32 MiB tmpfs on ``/dev/shm``, and a driver process in it
(``small_shm_script.py``) streams 16 MiB tensors, made in the workers or dealt out by a
dispatcher, with ``pin_memory`` off and on, and once more with ``/dev/shm`` filled to the
last page beforehand. Every item must arrive with the bytes its maker wrote, and
``/dev/shm``, read after every item and after the shutdown, must never hold a file of the
service's nor grow by more than a page or so: a few items in flight would not fit in it.

That page or so is multiprocessing's shared heap, which holds the service's small tables
(liveness, statistics: a few KiB) and goes to the temporary directory instead when
``/dev/shm`` has no room, as the "full" cases show.

Needs root (or the right to make a mount namespace) and ``unshare``; skipped, with the
reason, where either is refused.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = pathlib.Path(__file__).with_name("small_shm_script.py")
SHM_MIB = 32
ITEM_MIB = 16
ITEMS = 32
MOUNT = f"mount -t tmpfs -o size={SHM_MIB}m tmpfs /dev/shm"
# Far below one item: room for multiprocessing's shared heap (a page), never for an item or a ring.
SHM_ALLOWANCE = 256 << 10

CASES = {
    f"{pipe}-pin_memory={pin}": {"pipe": pipe, "n": ITEMS, "mib": ITEM_MIB, "workers": 2, "pin_memory": pin}
    for pipe in ("workers", "dispatch")
    for pin in (False, True)
}
CASES.update(
    {
        f"{pipe}-full": {"pipe": pipe, "n": ITEMS, "mib": ITEM_MIB, "workers": 2, "pin_memory": False, "full": True}
        for pipe in ("workers", "dispatch")
    }
)


def _namespace_refusal() -> str | None:
    """Why a mount namespace with a small ``/dev/shm`` cannot be made here, or None."""
    if shutil.which("unshare") is None:
        return "the unshare program is not installed"
    try:
        probe = subprocess.run(["unshare", "-m", "sh", "-c", MOUNT], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "unshare -m with a tmpfs mount did not finish in 30 s"
    if probe.returncode != 0:
        return f"unshare -m with a tmpfs mount on /dev/shm was refused: {probe.stderr.strip()[-300:]}"
    return None


def _run_in_namespace(cases: dict[str, dict], timeout: float = 240) -> dict[str, dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    command = f'{MOUNT} && exec "$0" -W ignore "$1" "$2"'
    # A session of its own, so that a driver past its time goes with its children.
    driver = subprocess.Popen(
        ["unshare", "-m", "sh", "-c", command, sys.executable, str(SCRIPT), json.dumps(cases)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = driver.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(driver.pid, signal.SIGKILL)
        out, err = driver.communicate(timeout=30)
        pytest.fail(f"the driver did not finish in {timeout:.0f} s:\n{err[-3000:]}")
    assert driver.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    refusal = _namespace_refusal()
    if refusal is not None:
        pytest.skip(refusal)
    return _run_in_namespace(CASES)  # one interpreter start for every case


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_large_tensors_stream_with_a_tiny_dev_shm(results, case):
    result = results[case]
    if "unsupported" in result:
        pytest.skip(result["unsupported"])
    assert "error" not in result, result["error"]
    assert result["shm_size"] == SHM_MIB << 20  # the driver saw the namespace's small tmpfs
    assert result["arrived"] == list(range(ITEMS))
    assert result["damaged"] == []
    if CASES[case].get("full"):
        assert result["shm_free_at_start"] < 64 << 10  # nothing of any size fitted
    assert result["shm_grew"] <= SHM_ALLOWANCE, result
    assert result["shm_seen"] == [] and result["shm_left"] == []

