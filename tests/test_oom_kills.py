"""A worker taken by the kernel's out-of-memory killer is named as such: the cgroup's count
of OOM kills, read when the service starts and again at a death (``runtime/main/oom.py``).

The count is faked (the reader pointed at a file of the test's, which the dying worker
raises before it kills itself with SIGKILL), and, where this machine lets a test make a
cgroup with a memory limit, a real OOM kill is provoked in a child interpreter placed in one."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import uuid
import warnings

import pytest
import torch
from torch.utils.data import Dataset

import mprs_plus
from mprs_plus.runtime.main import oom

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class KilledLikeTheOomKiller(Dataset):
    """Index ``at`` raises the fake cgroup's ``oom_kill`` count, then SIGKILLs its process
    (the first time only where ``marker`` is given)."""

    def __init__(self, events, at=5, marker=None, n=24):
        self.events, self.at, self.marker, self.n = events, at, marker, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.at and not (self.marker and os.path.exists(self.marker)):
            if self.marker:
                open(self.marker, "w").close()
            count = oom.read_count(self.events) or 0
            with open(self.events, "w") as f:
                f.write(f"low 0\nhigh 0\nmax 3\noom {count + 1}\noom_kill {count + 1}\n")
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.tensor([i])


@pytest.fixture
def fake_cgroup(tmp_path, monkeypatch):
    """A cgroup v2 ``memory.events`` of the test's, which the reader reads instead of this
    process's cgroup's."""
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n")
    monkeypatch.setattr(oom, "counters", lambda: [oom.Counter(str(events), "cgroup /test")])
    return str(events)


def test_the_count_is_read_from_v2_and_v1_files_and_found_from_proc_self_cgroup(tmp_path):
    root = tmp_path / "cgroup"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "memory.events").write_text("low 0\noom 2\noom_kill 2\noom_group_kill 0\n")
    (root / "memory" / "x").mkdir(parents=True)
    (root / "memory" / "x" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 7\n")
    proc = tmp_path / "cgroup-of-self"
    proc.write_text("4:memory:/x\n3:cpu:/\n0::/a/b\n")
    found = oom.counters(str(proc), str(root))
    assert sorted(c.where for c in found) == ["cgroup /a/b", "memory cgroup /x"]
    assert sorted(oom.read_count(c.path) for c in found) == [2, 7]
    assert oom.counters(str(tmp_path / "absent"), str(root)) == []
    kills = oom.OomKills(found)
    assert kills.rose() is None  # nothing new since it started
    (root / "memory" / "x" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 8\n")
    assert kills.rose() == "the out-of-memory killer (the oom_kill count of memory cgroup /x rose from 7 to 8)"
    assert kills.rose() is None  # the kill was told once


def test_a_dead_worker_whose_cgroup_counted_an_oom_kill_is_named_as_its_kill(fake_cgroup):
    loader = mprs_plus.DataLoader(KilledLikeTheOomKiller(fake_cgroup), batch_size=4, num_workers=1)
    with pytest.raises(RuntimeError) as caught:
        list(loader)
    message = str(caught.value)
    assert "is killed by signal: Killed" in message  # torch's words stay
    assert "the out-of-memory killer (the oom_kill count of cgroup /test rose from 0 to 1)" in message


def test_a_sigkill_without_an_oom_kill_counted_says_nothing_of_memory(tmp_path, fake_cgroup):
    from restart_datasets import Draws

    loader = mprs_plus.DataLoader(Draws(kill_at=5, poison=True), batch_size=4, num_workers=1)
    with pytest.raises(RuntimeError) as caught:
        list(loader)
    assert "is killed by signal: Killed" in str(caught.value)
    assert "out-of-memory killer (" not in str(caught.value)


def test_a_replaced_worker_killed_by_the_oom_killer_says_so_in_the_warning_and_the_stats(tmp_path, fake_cgroup):
    dataset = KilledLikeTheOomKiller(fake_cgroup, marker=str(tmp_path / "killed"))
    loader = mprs_plus.DataLoader(dataset, batch_size=4, num_workers=2, worker_restarts=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [int(x) for batch in loader for x in batch]
    assert got == list(range(24))
    said = [str(w.message) for w in caught if "A new worker replaces it" in str(w.message)]
    assert len(said) == 1 and "was killed by SIGKILL from the out-of-memory killer" in said[0]
    made = loader.stats().replacements
    assert len(made) == 1 and made[0].oom_kill and made[0].out_of_memory
    assert "1 killed by the out-of-memory killer" in loader.stats().summary()


def _own_memory_cgroup() -> str | None:
    """A folder where this test may make a memory cgroup (v1 or v2), None where it may not."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return None
    for counter in oom.counters():
        folder = os.path.dirname(counter.path)
        if os.access(folder, os.W_OK):
            return folder
    return None


_REAL_KILL = textwrap.dedent(
    """
    import os, sys
    cgroup = sys.argv[1]
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    import torch
    import mprs_plus

    class Touches(torch.utils.data.Dataset):
        def __len__(self):
            return 8
        def __getitem__(self, i):
            if i == 2:
                block = bytearray(int(sys.argv[2]))  # touched: zeroed pages are charged
                for k in range(0, len(block), 4096):
                    block[k] = 1
            return torch.tensor([i])

    loader = mprs_plus.DataLoader(Touches(), batch_size=2, num_workers=1)
    try:
        list(loader)
    except RuntimeError as exc:
        print(exc)
    """
)


@pytest.mark.timeout(120)
def test_a_real_oom_kill_in_a_small_cgroup_is_named(tmp_path):
    parent = _own_memory_cgroup()
    if parent is None:
        pytest.skip("this machine lets no test make a memory cgroup (not root, or no writable cgroup)")
    cgroup = os.path.join(parent, f"mprs_plus_test_{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(cgroup)
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup here: {exc}")
    try:
        limit = 600 << 20
        v1 = os.path.exists(os.path.join(cgroup, "memory.limit_in_bytes"))
        with open(os.path.join(cgroup, "memory.limit_in_bytes" if v1 else "memory.max"), "w") as f:
            f.write(str(limit))
        if v1 and os.path.exists(os.path.join(cgroup, "memory.memsw.limit_in_bytes")):
            with open(os.path.join(cgroup, "memory.memsw.limit_in_bytes"), "w") as f:
                f.write(str(limit))
        script = tmp_path / "oom_kill.py"
        script.write_text(_REAL_KILL)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        result = subprocess.run(
            [sys.executable, str(script), cgroup, str(2 * limit)],
            env=env,
            capture_output=True,
            text=True,
            timeout=100,
        )
        said = result.stdout + result.stderr
        assert "is killed by signal: Killed" in said, said[-3000:]
        assert "the out-of-memory killer (the oom_kill count of" in said, said[-3000:]
    finally:
        _remove_cgroup(cgroup)


def _remove_cgroup(cgroup: str) -> None:
    """The child interpreter has ended; a worker it left (it should leave none) is killed
    and reaped by the kernel before the cgroup can go (bounded: a few tries)."""
    import psutil

    for _ in range(5):
        try:
            os.rmdir(cgroup)
            return
        except OSError:
            with open(os.path.join(cgroup, "cgroup.procs")) as f:
                left = [psutil.Process(int(pid)) for pid in f.read().split() if psutil.pid_exists(int(pid))]
            for process in left:
                with contextlib.suppress(psutil.Error):
                    process.kill()
            psutil.wait_procs(left, timeout=5)
