"""Whether the kernel's out-of-memory killer took a process: its cgroup's count of OOM kills,
read around a death.

A worker killed by the OOM killer reads as "killed by SIGKILL", like one killed by anyone
else. Its memory, sampled twice a second, often misses the spike (a sample that touches a
gigabyte does so between two samples). The kernel counts its kills per cgroup:

    cgroup v2   <cgroup>/memory.events          "oom_kill N" (this cgroup and those below it)
    cgroup v1   <memory cgroup>/memory.oom_control  "oom_kill N" (this cgroup only)

where <cgroup> is this process's, from ``/proc/self/cgroup``: workers start in the cgroup of
the process that starts them. ``OomKills`` reads the counts when the service starts and
again at each death: a count that rose names the death as the OOM killer's. Two deaths
that share one kill are told apart by the order they are read in (the first takes it).
Where no count can be read (not Linux, no memory controller) nothing is said, as before.
"""

from __future__ import annotations

import os
from typing import NamedTuple

_CGROUP_ROOT = "/sys/fs/cgroup"
_PROC_CGROUP = "/proc/self/cgroup"


class Counter(NamedTuple):
    """One file that holds an ``oom_kill`` line, and how to name it."""

    path: str
    where: str  # "cgroup /a/b" (what a message says)


def counters(proc_cgroup: str = _PROC_CGROUP, root: str = _CGROUP_ROOT) -> list[Counter]:
    """The files that count this process's cgroups' OOM kills: v2's ``memory.events``,
    v1's ``memory.oom_control`` of the memory controller's cgroup; [] where there is none."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not hierarchy or not path.startswith("/"):
            continue
        relative = path.lstrip("/")
        if controllers == "":  # v2 (or the unified hierarchy beside v1)
            for base in (root, os.path.join(root, "unified")):
                candidate = os.path.join(base, relative, "memory.events")
                if os.path.exists(candidate):
                    found.append(Counter(candidate, f"cgroup {path}"))
                    break
        elif "memory" in controllers.split(","):
            candidate = os.path.join(root, "memory", relative, "memory.oom_control")
            if os.path.exists(candidate):
                found.append(Counter(candidate, f"memory cgroup {path}"))
    return found


def read_count(path: str) -> int | None:
    """The ``oom_kill`` count of one file; None where it cannot be read (a kernel before 4.13)."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        return None
    return None


class OomKills:
    """The OOM kill counts as last read; ``rose()`` says whether they rose since (see the
    module docstring). ``files``: the counters to read (the tests point it at their own)."""

    def __init__(self, files: list[Counter] | None = None) -> None:
        self.files = counters() if files is None else files
        self._seen = self._read()

    def _read(self) -> dict[str, int]:
        counts = {}
        for counter in self.files:
            count = read_count(counter.path)
            if count is not None:
                counts[counter.path] = count
        return counts

    def rose(self) -> str | None:
        """Read the counts again: where one rose since the last read, the words that say so
        ("the out-of-memory killer (the oom_kill count of cgroup /x rose from 0 to 1)"),
        else None. Either way the new counts are the next read's baseline."""
        if not self.files:
            return None
        now = self._read()
        said = None
        for counter in self.files:
            before, after = self._seen.get(counter.path), now.get(counter.path)
            if before is not None and after is not None and after > before:
                said = f"the out-of-memory killer (the oom_kill count of {counter.where} rose from {before} to {after})"
                break
        self._seen.update(now)
        return said
