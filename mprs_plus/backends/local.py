"""The default backend: each child is a process of this host, each channel a shared-memory
ring (or a pipe, see ``transport``)."""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..transport import open_channel


_UNGUARDED_MAIN = (
    "{name} cannot be started: this process is a worker that the {method!r} start method started, "
    "and it re-ran the main module, whose code started a loader. Put the code that creates and "
    "iterates loaders under `if __name__ == \"__main__\":` in the script you run, or use "
    "multiprocessing_context=\"fork\" where the platform has it."
)


class LocalBackend:
    """Children as processes of this host (``multiprocessing``, with the service's start method)."""

    def open(self, ctx: Any) -> LocalPlacement:
        return LocalPlacement(ctx)

    def __repr__(self) -> str:
        return "LocalBackend()"


class LocalPlacement:
    """A ``Placement`` (``backends/__init__.py``) on this host."""

    start_at_once = False  # under fork the children start with the first epoch (service.py)
    on_this_host = True

    def __init__(self, ctx: Any) -> None:
        from ..runtime.main.oom import OomKills

        self._ctx = ctx
        self.oom_kills = OomKills()  # the cgroup's OOM kills counted from here on (``runtime/main/oom.py``)

    def open_channel(
        self, *, capacity_items: int, capacity_bytes: int, control: bool = False, refill_at_half: bool = False
    ) -> tuple[Any, Any]:
        del control  # one kind of channel serves both here
        return open_channel(
            self._ctx, capacity_items=capacity_items, capacity_bytes=capacity_bytes, refill_at_half=refill_at_half
        )

    def start(self, name: str, target: Callable[[Any], None], setup: Any) -> Any:
        from ..runtime.main.diagnose import unpicklable_error

        process = self._ctx.Process(target=target, args=(setup,), name=name, daemon=True)
        try:
            with _interrupts_held():
                process.start()
        except KeyboardInterrupt:
            _end_unrecorded(process)
            raise
        except Exception as exc:
            method = self._ctx.get_start_method()
            if method == "fork":
                raise
            if getattr(multiprocessing.current_process(), "_inheriting", False):
                # This process is itself a child re-running the main module (spawn and
                # forkserver import it): the script starts its loader at import. That is the
                # error to show, not a diagnosis of what could not be pickled.
                raise RuntimeError(_UNGUARDED_MAIN.format(name=name, method=method)) from None
            raise unpicklable_error(setup, method, name) from exc
        return process

    def death_error(self, processes: Sequence[Any]) -> Exception:
        from ..runtime.main.lifecycle import death_error

        return death_error(processes, self.oom_kills.rose)

    def node_of(self, process: Any) -> str | None:
        return None  # this host

    def refresh_stats(self, table: Any, links: Sequence[Any]) -> None:
        pass  # the children write the shared table themselves

    def refused_connections(self, process: Any) -> int:
        return 0  # no child listens: its channels are this host's shared memory

    def close(self) -> None:
        pass


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Start a child with SIGINT blocked. Ctrl-C reaches the whole process group, and a
    child ignores SIGINT only once its setup runs (``runtime/child/lifecycle.py``): one
    pressed before that would kill it with a traceback. A fork and an exec keep the
    signal mask, so the child holds such a SIGINT pending until its setup ignores and
    unblocks it; this process handles its own as soon as the start returns. (A forkserver
    child is forked by the server, whose mask this does not set.)"""
    # Python handles a pending signal inside ``pthread_sigmask``, after the mask changed: a
    # Ctrl-C just before the block raises from the blocking call itself. So the mask to
    # restore is read first (a query changes nothing), and the block is inside the try:
    # SIGINT cannot stay blocked for good, which would make every later Ctrl-C pend unseen.
    before = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _end_unrecorded(process: Any) -> None:
    """A Ctrl-C held during the start raises as it ends, before the caller records the
    child: end it here, or it would run on unknown to the stop."""
    from ..runtime.main.lifecycle import DEATH_GRACE

    if process.pid is None:
        return  # never started
    with contextlib.suppress(Exception):
        process.kill()
        process.join(DEATH_GRACE)
