"""Hugging Face Accelerate, and so Transformers' ``Trainer``, on ``mprs_plus.DataLoader``.

    import mprs_plus.integrations.accelerate
    mprs_plus.integrations.accelerate.enable()     # once, before loaders are prepared

Accelerate does not iterate the loader it is given. ``accelerator.prepare(loader)`` reads
the loader's arguments and builds its own wrapper (``DataLoaderShard``, or
``DataLoaderDispatcher``), which makes a new loader of torch's class (torchdata's
``StatefulDataLoader`` with ``use_stateful_dataloader=True``) in the ``__init__`` of their
common base, ``DataLoaderAdapter``; ``skip_first_batches`` builds one the same way (of a
loader not prepared: torch's, without a wrapper), and ``Trainer`` builds torch's loader
and prepares it. Accelerate has no hook for that class, so ``enable()`` replaces three
methods and a name until ``disable()``:

    Accelerator.prepare_data_loader     notes the loader being prepared, whose own
                                        arguments (device=, backend=, ...) Accelerate
                                        does not read
    DataLoaderAdapter.__init__          builds mprs_plus.DataLoader from the arguments
                                        Accelerate chose (its batch sampler sharded by
                                        process, ...) and those noted
    DataLoaderAdapter.load_state_dict   also refreshes the state save_state() writes
    accelerate.data_loader.DataLoader   torch's class, which skip_first_batches builds
                                        for a loader not prepared: this one instead

The loader built keeps the arguments of this class that torch's has not (``device=``,
``worker_restarts=``, ...) from the loader being prepared; one built from torch's loader
(``Trainer``'s) takes those given to ``enable()``.

Everything else of the wrapper works as it does around torch's loader: sharding by
process, device placement, ``set_epoch``, gradient accumulation's end of epoch. Two
things change, both to keep the batches exact:

- ``save_state()`` / ``load_state()`` keep the loader's state (its ``state_dict()``) as
  they do for ``StatefulDataLoader``, whatever ``use_stateful_dataloader`` says.
- ``skip_first_batches(loader, n)`` wraps the batch sampler in one that skips n index
  batches, so torch's workers then see other batches than in the run being resumed, and
  draw other random numbers for them. Here the loader gets the batch sampler unwrapped
  and a state n batches into its first epoch: each worker re-reads its share of the
  skipped batches' samples (and drops them, as a restore does), and the batches after them are the
  uninterrupted run's, random augmentations included. Later epochs are whole (torch's
  skipping sampler skips n batches in every epoch).

The methods replaced are Accelerate's internals: ``enable()`` checks the version against
the range tested (``SUPPORTED``) and the shape of what it replaces, and raises, saying
what to do, rather than leave Accelerate's own loader in place without a word.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
import threading
import weakref
from typing import Any

from ..dataloader import DataLoader
from ..dataloader import state as loader_state

SUPPORTED = ">=1.0,<1.17"
"""The Accelerate releases this module was tested with (a PEP 440 specifier): 1.0, 1.8,
1.12, 1.15 and 1.16 (Transformers' ``Trainer`` needs 1.1 or later)."""

_ADAPTER_INIT = ["self", "dataset", "use_stateful_dataloader", "batch_sampler", "kwargs"]

# The loader ``Accelerator.prepare_data_loader`` is preparing, while it does.
_PREPARING: contextvars.ContextVar[Any] = contextvars.ContextVar("mprs_plus_accelerate_preparing", default=None)
_lock = threading.Lock()
_originals: dict[str, Any] | None = None  # what enable() replaced, for disable()
# This class's own arguments, which torch's loader has not: a loader built from torch's
# (Transformers' Trainer makes one) takes those given to enable(); one built from this
# class takes that loader's.
_OWN = ("device", "backend", "collect_stats", "snapshot_every_n_steps", "worker_restarts", "seeding")
_options: dict[str, Any] = {}  # given to enable()
_built: list[weakref.ref[DataLoader]] = []  # the loaders built here, newest last


def enable(**options: Any) -> None:
    """From now on, every loader Accelerate prepares (``accelerator.prepare()``,
    ``skip_first_batches()``, Transformers' ``Trainer``) runs on ``mprs_plus.DataLoader``.

    Call it once, before your loaders are prepared (with ``Trainer``: before
    ``trainer.train()``); a second call only sets the options it names. ``options``:
    arguments of ``mprs_plus.DataLoader`` that torch's has not (``worker_restarts``,
    ``device``, ``backend``, ``collect_stats``, ``snapshot_every_n_steps``, ``seeding``), for the
    loaders built from torch's, such as the one ``Trainer`` makes; a loader of this class
    keeps its own. Raises ``TypeError`` for another name, ``ImportError`` without
    Accelerate, and ``RuntimeError`` for a release outside ``SUPPORTED``, whose internals
    this module was not tested with."""
    global _originals
    unknown = sorted(set(options) - set(_OWN))
    if unknown:
        raise TypeError(
            f"enable() takes the arguments of mprs_plus.DataLoader that torch's DataLoader has not "
            f"({', '.join(_OWN)}), not {', '.join(unknown)}: the others come from the loader being prepared"
        )
    with _lock:
        if _originals is not None:
            _options.update(options)
            return
        accelerator, data_loader = _checked_modules()
        adapter = data_loader.DataLoaderAdapter
        originals = {
            "prepare_data_loader": accelerator.Accelerator.__dict__["prepare_data_loader"],
            "__init__": adapter.__dict__["__init__"],
            "load_state_dict": adapter.__dict__["load_state_dict"],
            "DataLoader": data_loader.DataLoader,
        }
        skip_sampler = data_loader.SkipBatchSampler
        prepare, load = originals["prepare_data_loader"], originals["load_state_dict"]

        @functools.wraps(prepare)
        def prepare_data_loader(self: Any, given: Any, *args: Any, **kwargs: Any) -> Any:
            token = _PREPARING.set(given)
            try:
                return prepare(self, given, *args, **kwargs)
            finally:
                _PREPARING.reset(token)

        def __init__(self: Any, dataset: Any, use_stateful_dataloader: bool = False, batch_sampler: Any = None, **kwargs: Any) -> None:
            # Accelerate's own picks torch's DataLoader or StatefulDataLoader; this class
            # has the latter's state_dict(), which save_state() keeps when this flag is set.
            self.use_stateful_dataloader = True
            self.base_dataloader = _build(dataset, batch_sampler, kwargs, skip_sampler)
            self.dl_state_dict = self.base_dataloader.state_dict()

        def load_state_dict(self: Any, state_dict: Any) -> None:
            load(self, state_dict)
            if isinstance(self.base_dataloader, DataLoader):
                # A save_state() before the next batch writes the state just loaded.
                self.dl_state_dict = self.base_dataloader.state_dict()

        def build_loader(dataset: Any, batch_sampler: Any = None, **kwargs: Any) -> DataLoader:
            return _build(dataset, batch_sampler, kwargs, skip_sampler)

        accelerator.Accelerator.prepare_data_loader = prepare_data_loader
        adapter.__init__ = __init__
        adapter.load_state_dict = load_state_dict
        data_loader.DataLoader = build_loader
        _options.clear()
        _options.update(options)
        _originals = originals


def disable() -> None:
    """Undo ``enable()``: loaders prepared from now on are Accelerate's own again (those
    prepared before keep running on this project's workers)."""
    global _originals
    with _lock:
        if _originals is None:
            return
        accelerator = importlib.import_module("accelerate.accelerator")
        data_loader = importlib.import_module("accelerate.data_loader")
        accelerator.Accelerator.prepare_data_loader = _originals["prepare_data_loader"]
        data_loader.DataLoaderAdapter.__init__ = _originals["__init__"]
        data_loader.DataLoaderAdapter.load_state_dict = _originals["load_state_dict"]
        data_loader.DataLoader = _originals["DataLoader"]
        _options.clear()
        _originals = None


def _checked_modules() -> tuple[Any, Any]:
    try:
        accelerate = importlib.import_module("accelerate")
    except ImportError as exc:
        raise ImportError(
            "mprs_plus.integrations.accelerate.enable() needs Hugging Face Accelerate: "
            f"pip install 'accelerate{SUPPORTED}'"
        ) from exc
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    found = getattr(accelerate, "__version__", "unknown")
    try:
        supported = Version(found) in SpecifierSet(SUPPORTED)
    except InvalidVersion:
        supported = False
    advice = (
        f"install a supported release (pip install 'accelerate{SUPPORTED}'), or leave enable() out: "
        "Accelerate then runs torch's DataLoader in place of mprs_plus.DataLoader"
    )
    if not supported:
        raise RuntimeError(
            f"mprs_plus.integrations.accelerate supports accelerate{SUPPORTED}, and accelerate {found} is "
            "installed: enable() replaces parts of Accelerate's data loader wrapper, which change between "
            f"releases, and was not tested with this one. To keep the engine, {advice}"
        )
    import torch.utils.data

    accelerator = importlib.import_module("accelerate.accelerator")
    data_loader = importlib.import_module("accelerate.data_loader")
    adapter = getattr(data_loader, "DataLoaderAdapter", None)
    shape_ok = (
        adapter is not None
        and "__init__" in vars(adapter)
        and "load_state_dict" in vars(adapter)
        and list(inspect.signature(adapter.__init__).parameters) == _ADAPTER_INIT
        and isinstance(getattr(data_loader, "SkipBatchSampler", None), type)
        and getattr(data_loader, "DataLoader", None) is torch.utils.data.DataLoader
        and "prepare_data_loader" in vars(getattr(accelerator, "Accelerator", object))
    )
    if not shape_ok:
        raise RuntimeError(
            f"accelerate {found} is not shaped as the releases mprs_plus.integrations.accelerate was tested "
            "with (accelerate.data_loader's DataLoaderAdapter.__init__, SkipBatchSampler and DataLoader, "
            f"Accelerator.prepare_data_loader): {advice}"
        )
    return accelerator, data_loader


def _build(dataset: Any, batch_sampler: Any, kwargs: dict[str, Any], skip_sampler: type) -> DataLoader:
    """The loader Accelerate's wrapper runs: ``mprs_plus.DataLoader`` with the arguments
    Accelerate chose and the noted loader's own; a skipping batch sampler (from
    ``skip_first_batches``) becomes a state that far into the first epoch."""
    kwargs = dict(kwargs)
    skipped = 0
    if isinstance(batch_sampler, skip_sampler):
        batch_sampler, skipped = batch_sampler.batch_sampler, batch_sampler.skip_batches
    elif isinstance(kwargs.get("sampler"), skip_sampler):  # a batch sampler passed as the sampler
        kwargs["sampler"], skipped = kwargs["sampler"].batch_sampler, kwargs["sampler"].skip_batches
    origin = _origin(dataset, batch_sampler if batch_sampler is not None else kwargs.get("sampler"))
    if origin is not None:
        kwargs.update({name: getattr(origin, name) for name in _OWN})
        if kwargs.get("num_workers"):
            # torch's attribute reads 2 whatever was asked; keep what the user asked.
            kwargs["prefetch_factor"] = origin._prefetch_asked
    else:
        kwargs.update(_options)
    loader = DataLoader(dataset, batch_sampler=batch_sampler, **kwargs)
    if origin is not None:
        loader._family = origin._family  # the loader the user holds reports this one's stats()
    _remember(loader)
    if skipped:
        loader.load_state_dict(loader_state.skipping(loader.state_dict(), skipped))
    return loader


def _origin(dataset: Any, batch_sampler: Any) -> DataLoader | None:
    """The ``mprs_plus.DataLoader`` this one is rebuilt from, if any: the one being
    prepared, or (``skip_first_batches`` of a prepared loader) the loader built here
    whose batch sampler (an iterable dataset: dataset) the new one takes."""
    preparing = _PREPARING.get()
    if preparing is not None:
        return preparing if isinstance(preparing, DataLoader) else None
    for ref in reversed(_built):
        loader = ref()
        if loader is None:
            continue
        if batch_sampler is not None and (batch_sampler is loader.batch_sampler or batch_sampler is loader.sampler):
            return loader
        if batch_sampler is None and loader.dataset is dataset:
            return loader
    return None


def _remember(loader: DataLoader) -> None:
    _built[:] = [ref for ref in _built if ref() is not None]
    _built.append(weakref.ref(loader))
