"""What has gone through a channel, as either end can see it (for live statistics)."""

from __future__ import annotations

from typing import NamedTuple


class Traffic(NamedTuple):
    messages: int  # messages written so far
    bytes: int  # bytes written so far, framing included
    queued_messages: int  # written, not yet read
    queued_bytes: int
    # Wake-ups the watchdog stood in for, both ends together (see ``_wakeup.py``): always
    # 0 unless the transport has a bug; a non-zero figure cost latency, not items.
    rescues: int = 0


NO_TRAFFIC = Traffic(0, 0, 0, 0)
