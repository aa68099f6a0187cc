"""The kinds of process a pipeline runs in.

A Plan puts every DataPipe in one segment, and the runtime names each of its processes
by the segment it runs: one enum for both, so that no part of the package spells a role
as a string and parses it back. A leaf module (nothing of the package below it), so that
the plan, its renderings and both sides of the runtime can all import it.
"""

from __future__ import annotations

import enum


class Segment(enum.StrEnum):
    """The kind of process a DataPipe runs in; a ``str`` that prints as its value."""

    DISPATCH = "dispatch"
    WORKER = "worker"
    MAIN = "main"
