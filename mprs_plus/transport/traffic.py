"""What has gone through a channel, as either end can see it, and what a process's
receivers lent their users (for live statistics)."""

from __future__ import annotations

from typing import NamedTuple


class Traffic(NamedTuple):
    messages: int  # messages written so far
    bytes: int  # bytes written so far, framing included
    queued_messages: int  # written, not yet read
    queued_bytes: int
    # Wake-ups the watchdog stood in for although the waker had looked, both ends together
    # (see ``_wakeup.py``): always 0 unless the transport has a bug; a non-zero figure
    # cost latency, not items.
    rescues: int = 0
    # Large buffers sent from the lend-area extent they were built in, without a copy
    # (``_lend.py``, Built in place), and those the sender copied into an extent (0 on
    # transports without a lend area).
    lent_in_place: int = 0
    lent_copied: int = 0
    # Wake-ups the watchdog delivered because the waker, having published, was kept off
    # the CPU before it looked (a loaded machine, not a bug; ``_wakeup.py``).
    late_wakeups: int = 0


NO_TRAFFIC = Traffic(0, 0, 0, 0)


class Lending(NamedTuple):
    """What this process's receivers did with large buffers, since the process started
    (``_lend.py``): handed over as views of shared memory, or copied."""

    lent: int  # buffers handed over as views of shared memory
    # Buffers large enough to lend that arrived as copies: the receiver's user held its
    # limit already, or the sender had no free extent or slot in its lend area.
    copied: int
    held_buffers: int  # lent buffers the user still holds now
    held_bytes: int
    # Lent buffers the user dropped whose extents wait for device work enqueued before the
    # drop (a copy to the GPU from page-locked memory) to finish before they go back.
    awaiting_device: int = 0
