"""``ray.get`` as the training process calls it: an error it raises keeps no frame alive;
and the helper thread for a call to Ray that no timeout reaches (``in_helper``).

An error that ``ray.get`` raises (an actor's death, a failed call, a timeout) sits in a
reference cycle with Ray's own frames, and a frame holds its caller's: every frame of the
stack stays alive with what it held (the loader, the service's runtime, the user's locals)
until Python's collector runs, maybe minutes later. The runtime's stop waits for its last
reference, so a loader dropped after one of its actors died kept its actors (and their
landing processes) running until then. Clearing the finished frames of the error's
traceback, and of the errors it was raised from, breaks the cycle at once; the traceback
still names each frame and line.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections.abc import Callable
from typing import Any

import ray


def get_without_cycle(ref: Any, timeout: float) -> Any:
    """``ray.get(ref, timeout=timeout)``; what it raises is raised with its frames cleared."""
    try:
        return ray.get(ref, timeout=timeout)
    except BaseException as exc:
        _forget_frames(exc)
        raise


def _forget_frames(exc: BaseException | None) -> None:
    """Clear the local variables of the finished frames in ``exc``'s traceback and in those
    of its cause and context (a frame still running is left as it is)."""
    seen: set[int] = set()
    pending = [exc]
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        pending += [error.__cause__, error.__context__]


def in_helper(call: Callable[[], Any], name: str) -> threading.Thread:
    """``call`` started in a daemon thread named ``name``, its exceptions dropped: a call
    that may wait on Ray's control store in native code, where no timeout reaches it. The
    caller joins it with a timeout, or not at all."""

    def run() -> None:
        with contextlib.suppress(Exception):
            call()

    helper = threading.Thread(target=run, name=name, daemon=True)
    helper.start()
    return helper
