"""numpy's global generator, seeded at each epoch as torchdata seeds it, loaded only if used.

torchdata's per-epoch reseeding (``process_reset_fn``) seeds ``random``, ``torch`` and numpy's
global generator, and ``numpy.random.seed`` loads numpy's random module (about 8 ms) in a
child whose pipeline may never draw from it. While a child resets its segment
(``control.py``), ``deferred_numpy_seed`` hands torchdata a stand-in for ``numpy`` whose
``random.seed(value)`` does one of two things:

    numpy.random loaded already      numpy.random.seed(value), as torchdata would
    numpy.random not loaded          remember value; the first import of numpy.random in
                                     this process (by a hook, the pipeline, anyone) seeds
                                     it with the latest value before anything can draw

Nothing can draw from a generator that is not loaded, so the pipeline sees the state it
would have seen: the same values as with torchdata's reseeding, drawn or not, and the same
seed generator (torchdata still draws its numpy seed from it). A torchdata without the
module attributes this relies on is seeded as before.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


NUMPY_RANDOM = "numpy.random"


class _SeedOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """On ``sys.meta_path`` while a seed waits: finds numpy.random with the finders after it,
    loads it with their loader, seeds it, then leaves ``sys.meta_path``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pending: int | None = None
        self._loader: Any = None

    def arm(self, value: int) -> None:
        with self._lock:
            self.pending = value
            if self not in sys.meta_path:
                sys.meta_path.insert(0, self)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != NUMPY_RANDOM:
            return None
        for finder in [f for f in sys.meta_path if f is not self]:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        loader = self._loader
        module.__loader__ = module.__spec__.loader = loader
        loader.exec_module(module)
        with self._lock:
            value, self.pending = self.pending, None
            if self in sys.meta_path:
                sys.meta_path.remove(self)
        if value is not None:
            module.seed(value)


_HOOK = _SeedOnImport()


class _DeferredRandom:
    """What torchdata's seeding reaches as ``numpy.random`` during a reset."""

    def __init__(self, numpy: Any) -> None:
        self._numpy = numpy

    def seed(self, value: int) -> None:
        if NUMPY_RANDOM in sys.modules:
            self._numpy.random.seed(value)
        else:
            _HOOK.arm(value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._numpy.random, name)


class _NumpyStandIn:
    """numpy as torchdata's seeding sees it during a reset: its ``random`` is deferred."""

    def __init__(self, numpy: Any) -> None:
        self._numpy = numpy
        self.random = _DeferredRandom(numpy)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._numpy, name)


@contextmanager
def deferred_numpy_seed() -> Iterator[None]:
    """Run torchdata's reseeding inside this: numpy.random is seeded, or seeded on load."""
    from torchdata.dataloader2.utils import worker as _torchdata_worker

    numpy = getattr(_torchdata_worker, "numpy", None)
    if not getattr(_torchdata_worker, "HAS_NUMPY", False) or numpy is None or isinstance(numpy, _NumpyStandIn):
        yield
        return
    _torchdata_worker.numpy = _NumpyStandIn(numpy)
    try:
        yield
    finally:
        _torchdata_worker.numpy = numpy


def seed_numpy(value: Any) -> None:
    """Seed numpy's global generator with ``value`` now if numpy.random is loaded, else the
    moment it is first imported in this process (a front end seeding its workers itself)."""
    if NUMPY_RANDOM in sys.modules:
        sys.modules[NUMPY_RANDOM].seed(value)
    else:
        _HOOK.arm(value)
