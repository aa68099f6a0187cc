"""Copies into memory that another process reads: written past this core's caches.

Why
    A worker that stacks a batch into its channel's lend area (``Sender.borrow``) writes
    bytes it never reads again: the main process does. An ordinary copy (``memcpy``,
    ``torch.stack``) first reads every destination line into this core's caches, then
    leaves it there dirty, evicting what the worker is about to use (the samples it is
    stacking, the next ones it makes). glibc switches to streaming stores only for copies
    larger than a threshold it derives from the cache size, hundreds of MiB on some
    machines, and never for a batch made of separate samples. On 1 MiB tensors in batches
    of 8, two workers on two cores spent 95-120 us stacking each sample; with streaming
    stores 45-70, and making the sample got cheaper too (docs/benchmarks.md, Cheap samples).

What
    ``copy_into(out, offset, source)`` and ``copy_from_address(out, offset, address,
    nbytes)`` write the bytes with SSE2 streaming stores (part of every x86-64 processor)
    and end with a store fence, so that the frame published after the copy is seen after
    its bytes. Each holds or releases the GIL as the copy it replaces did (the sender's
    slice assignment holds it, ``torch.stack`` releases it). They come from a small C extension
    (``_streaming.c``) that the package builds where a compiler is at hand; without it,
    on another processor, or with ``MPRS_PLUS_STREAMING_STORES=0``, ``ENABLED`` is False
    and callers copy as before: the bytes are the same either way.
"""

from __future__ import annotations

import os

try:
    from ._streaming import STREAMING as _BUILT_STREAMING, copy_from_address, copy_into
except ImportError:  # built without a compiler: copies take the ordinary path
    _BUILT_STREAMING = 0
    copy_from_address = copy_into = None  # type: ignore[assignment]

_SWITCH = "MPRS_PLUS_STREAMING_STORES"


def _enabled() -> bool:
    value = os.environ.get(_SWITCH, "1").strip().lower()
    if value not in ("0", "1", "off", "on", "false", "true", ""):
        raise ValueError(f"{_SWITCH} must be 0 or 1, not {value!r}")
    return bool(_BUILT_STREAMING) and value not in ("0", "off", "false")


# Read once, at import: a worker decides as its parent did (fork) or as its environment says.
ENABLED = _enabled()

# Bytes. A smaller copy is left to memcpy: the caller's per-copy checks cost more than the
# streaming stores save. Batches of uint8 samples, 2 workers, samples/s against memcpy:
# 16 KiB samples 76-78k against 79-83k; 64 KiB 60-66k against 55-62k; 147 KiB (3 x 224 x
# 224) 46-50k against 39-45k; 1 MiB +24%.
MIN_BYTES = 64 << 10


def streams(nbytes: int) -> bool:
    """Whether a copy of ``nbytes`` into another process's memory should stream."""
    return ENABLED and nbytes >= MIN_BYTES


__all__ = ["ENABLED", "MIN_BYTES", "copy_from_address", "copy_into", "streams"]
