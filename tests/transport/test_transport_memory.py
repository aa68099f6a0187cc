"""Shared memory is committed as messages use it, not when a channel opens.

Committed here means resident shmem pages of the channel's mapping (``/proc/self/smaps``):
what a loader holds at rest, per channel, whatever the ring's capacity.
"""

from __future__ import annotations

import multiprocessing

import numpy as np
import psutil
from transport_peers import shm_only

from mprs_plus.transport import open_channel

MiB = 1 << 20


def committed_mib() -> float:
    maps = psutil.Process().memory_maps(grouped=False)
    return sum(m.rss for m in maps if "memfd:mprs_plus" in m.path) / MiB


@shm_only
def test_opening_a_channel_commits_no_ring_memory_and_a_message_only_what_it_touches():
    before = committed_mib()
    sender, receiver = open_channel(multiprocessing.get_context("fork"), capacity_items=4, capacity_bytes=64 * MiB)
    try:
        assert committed_mib() - before < 0.1  # the control page at most, never the 64 MiB ring
        sender.send(np.ones(MiB // 8))  # 1 MiB
        assert np.array_equal(receiver.recv(timeout=10), np.ones(MiB // 8))
        used = committed_mib() - before
        assert 1 <= used < 2
    finally:
        sender.close()
        receiver.close()
