"""What has gone through a channel, as either end can see it (for live statistics)."""

from __future__ import annotations

from typing import NamedTuple


class Traffic(NamedTuple):
    messages: int  # messages written so far
    bytes: int  # bytes written so far, framing included
    queued_messages: int  # written, not yet read
    queued_bytes: int


NO_TRAFFIC = Traffic(0, 0, 0, 0)
