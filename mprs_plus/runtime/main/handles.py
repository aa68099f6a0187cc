"""A child process as torch's loader shows its workers: ``pid``, ``exitcode``,
``is_alive()``, ``join()``.

Code written for torch's loader reads its iterator's ``_workers`` to watch the workers
(their pids, whether they are alive, their exit codes). A ``ChildHandle`` answers the same
questions of one child, whatever runs it (a process of this host, a Ray actor), and follows
its link (``topology.ChildLink``): it answers for a child not started yet (fork starts
children with the first epoch) and for one reaped since (its link keeps a record).
"""

from __future__ import annotations

from typing import Any

from .topology import ChildLink


class ChildHandle:
    """One child, read through its link; never starts or stops it."""

    __slots__ = ("_link",)

    def __init__(self, link: ChildLink) -> None:
        self._link = link

    def _process(self) -> Any:
        return self._link.process  # None before the start; a record once reaped

    @property
    def name(self) -> str:
        return self._link.name

    @property
    def pid(self) -> int | None:
        process = self._process()
        return None if process is None else process.pid

    @property
    def exitcode(self) -> int | None:
        process = self._process()
        return None if process is None else process.exitcode

    def is_alive(self) -> bool:
        process = self._process()
        if process is None or not hasattr(process, "is_alive"):  # not started, or reaped
            return False
        try:
            return process.is_alive()
        except ValueError:  # closed as it was reaped, between the two reads
            return False

    def join(self, timeout: float | None = None) -> None:
        """Wait for the child to end (at most ``timeout`` seconds); it is not asked to."""
        process = self._process()
        if process is None or not hasattr(process, "join"):
            return
        try:
            process.join(timeout)
        except ValueError:  # closed as it was reaped: it has ended
            return

    def __repr__(self) -> str:
        return f"<{self.name} pid={self.pid} exitcode={self.exitcode}>"
