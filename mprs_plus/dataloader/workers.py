"""The runtime of a ``DataLoader``'s workers: the loader's plan (one ``LoaderStage``,
replicated in every worker) handed to the one runtime, fed to the device if asked.

It lives as long as something holds it: the loader (persistent workers) or an epoch's
iterator, as torch's iterator keeps its workers after its loader is gone. The runtime
stops itself once unreachable (``ServiceRuntime``'s finalizer), and so does the feeding."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

from .stage import LoaderStage, _Job


class LoaderRun:
    """One runtime of the loader's workers and the plan it runs."""

    def __init__(self, options: Any, job: _Job, num_workers: int, family: Any, pin_memory_device: str = "") -> None:
        from ..plan import plan
        from ..runtime.main.service import open_runtime

        if options.worker_restarts:  # the budget is the loader's: count what earlier runs spent
            options = options._replace(restarts_used=family.replacements_made())
        stage = LoaderStage(job)
        self.plan = plan(stage, num_workers)
        self.feeding = open_feeding(options, pin_memory_device)
        self._close_feeding: Any = None
        if self.feeding is not None:
            self.plan = self.plan._replace(delivery=self.feeding.delivery)
        self.runtime = open_runtime(stage, self.plan, options)
        with self.feeding.channels() if self.feeding is not None else contextlib.nullcontext():
            main = self.runtime.start()
        family.started(self.runtime.figures, same_budget=True)
        if self.feeding is not None:
            self.runtime.figures.feeding = self.feeding.counters
            main = self.feeding.wrap(main)
            # Closed once: by this finalizer, or by stop() calling it.
            self._close_feeding = weakref.finalize(self, self.feeding.close)
        self.main = main

    def stop(self) -> None:
        self.runtime.stop()
        if self._close_feeding is not None:
            self._close_feeding()


def open_feeding(options: Any, pin_memory_device: str = "") -> Any:
    """``pin_memory`` / ``device``: the runtime's feeding, None where none is asked for (or,
    with a warning, where there is no accelerator)."""
    if not options.pin_memory:
        return None
    from ..runtime.main.feeding import open_feeding as open_runtime_feeding

    return open_runtime_feeding(options.pin_memory, options.device, options.device_prefetch, pin_memory_device or None)
