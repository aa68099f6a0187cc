"""How the main process reads one worker output (branch) from the N workers' channels.

    in order (default)   worker 0, 1, ..., N-1, 0, ... one item each; exhausted workers
                         are skipped. Deterministic: the same seed gives the same order.
    as ready             items as the workers produce them, a batch at a time: the first
                         channel with a message wins. Every item still arrives exactly
                         once; the order depends on timing. For imbalanced per-item costs.

Both read through the service's ``ChannelMux``, so a reader that waits also drops stale
messages from every other channel, and a newer epoch ends an older reader.

Items of a batch already read wait in the reader (``pending``) until their turn: pausing
the DataLoader2 suspends the reader between two items and loses none of them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from .messages import Kind
from .mux import ChannelMux


def read_in_order(mux: ChannelMux, channels: Sequence[int], epoch: int) -> Iterator[Any]:
    pending: list[deque[Any]] = [deque() for _ in channels]
    active = list(range(len(channels)))
    position = 0
    take = mux.take
    while active:
        worker_id = active[position]
        queue = pending[worker_id]
        if queue:
            yield queue.popleft()
            position = position + 1 if position + 1 < len(active) else 0
            continue
        message = take(channels[worker_id], epoch)
        if message is None:
            return  # a newer epoch began: this one was abandoned
        kind, _, payload = message
        if kind == Kind.ITEMS:
            queue.extend(payload)
        elif kind == Kind.END:
            active.pop(position)
            if position >= len(active):
                position = 0
        else:
            raise payload.rebuild()


def read_as_ready(mux: ChannelMux, channels: Sequence[int], epoch: int) -> Iterator[Any]:
    open_channels = list(channels)
    take_any = mux.take_any
    while open_channels:
        channel, message = take_any(open_channels, epoch)
        if message is None:
            return
        kind, _, payload = message
        if kind == Kind.ITEMS:
            yield from payload
        elif kind == Kind.END:
            open_channels.remove(channel)
        else:
            raise payload.rebuild()
