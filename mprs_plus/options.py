"""The reading service's options, validated once, up front.

torchdata's keyword arguments are accepted as they are; everything below the
reading service receives this one immutable object instead of loose keywords. A named
tuple, not a frozen dataclass: a dataclass compiles its methods when its module loads,
which a training script's first loader waits for.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any, NamedTuple


class _Fields(NamedTuple):
    num_workers: int = 0
    multiprocessing_context: str | None = None
    worker_prefetch_cnt: int = 10
    main_prefetch_cnt: int = 10
    worker_init_fn: Callable[..., Any] | None = None
    worker_reset_fn: Callable[..., Any] | None = None
    # Beyond torchdata's arguments:
    dispatch_init_fn: Callable[..., Any] | None = None
    dispatch_buffer_size: int | None = None
    in_order: bool = True
    timeout: float | None = None
    collect_stats: bool = True
    stats_interval: float | None = None
    # Where the children run (``backends``): None for processes of this host.
    backend: Any = None
    # Feeding an accelerator (``runtime/main/feeding.py``): items page-locked, and with
    # ``device`` moved there on a stream of the service's own, ``device_prefetch`` ahead.
    pin_memory: bool = False
    device: Any = None
    device_prefetch: int = 2
    # Items each worker output may produce beyond those the main process handed out (its
    # window: ``runtime/window.py``), as torch's ``prefetch_factor``; None: its channel bounds it.
    items_ahead: int | None = None
    # Dead workers replaced in the service's life, all workers together (``runtime/main/replacement.py``).
    worker_restarts: int = 0
    restarts_used: int = 0  # of that budget, by earlier runtimes of the same loader
    # Record a timeline of every process (``runtime/timeline.py``): False, True, or the
    # records kept per lane.
    timeline: bool | int = False


class Options(_Fields):
    __slots__ = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> Options:
        self = super().__new__(cls, *args, **kwargs)
        self._validate()
        return self

    def _validate(self) -> None:
        if self.backend is not None and not callable(getattr(self.backend, "open", None)):
            raise TypeError(
                "backend must be a backend such as mprs_plus.RayBackend(...), or None; "
                f"got {type(self.backend).__name__}"
            )
        if self.stats_interval is not None and (
            isinstance(self.stats_interval, bool)
            or not isinstance(self.stats_interval, (int, float))
            or self.stats_interval <= 0
        ):
            raise ValueError(f"stats_interval must be a number of seconds > 0, or None; got {self.stats_interval!r}")
        if self.stats_interval is not None and not self.collect_stats:
            raise ValueError("stats_interval logs statistics: it needs collect_stats=True")
        if not isinstance(self.timeline, (bool, int)) or (
            not isinstance(self.timeline, bool) and self.timeline < 16
        ):
            raise ValueError(
                f"timeline must be True, False, or the number of records kept per process (>= 16); got {self.timeline!r}"
            )
        if self.timeline and not self.collect_stats:
            raise ValueError("timeline records the figures stats() adds up: it needs collect_stats=True")
        if self.timeout is not None and (
            isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or self.timeout <= 0
        ):
            raise ValueError(f"timeout must be a number of seconds > 0, or None to wait forever; got {self.timeout!r}")
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"pin_memory must be True or False, got {type(self.pin_memory).__name__}")
        if self.device is not None:
            kind = self.device if isinstance(self.device, str) else getattr(self.device, "type", None)
            if not isinstance(kind, str):
                raise TypeError(f"device must be a device name such as 'cuda' or 'cuda:1', or a torch.device; got {self.device!r}")
            if kind.split(":")[0] == "cpu":
                raise ValueError("device='cpu': items are already in host memory; leave device=None")
            if not self.pin_memory:
                raise ValueError(
                    f"device={str(self.device)!r} copies items from page-locked memory: pass pin_memory=True as well"
                )
        _non_negative_int("device_prefetch", self.device_prefetch)
        if self.device_prefetch == 0:
            raise ValueError("device_prefetch must be >= 1 (items copied to the device ahead of the loop)")
        if self.items_ahead is not None:
            _non_negative_int("items_ahead", self.items_ahead)
            if self.items_ahead == 0:
                raise ValueError("items_ahead must be >= 1 (items a worker may produce ahead), or None")
        _non_negative_int("worker_restarts", self.worker_restarts)
        if self.num_workers == "auto":
            raise ValueError(
                "num_workers='auto' is mprs_plus.DataLoader's: the reading service's workers each run a replica of "
                "the DataPipe graph, which shards by the worker count (sharding_filter), so the count cannot change "
                "while an epoch runs. Pass an int here, or use mprs_plus.DataLoader over a map-style dataset"
            )
        _non_negative_int("num_workers", self.num_workers)
        _non_negative_int("worker_prefetch_cnt", self.worker_prefetch_cnt)
        _non_negative_int("main_prefetch_cnt", self.main_prefetch_cnt)
        if self.dispatch_buffer_size is not None:
            _non_negative_int("dispatch_buffer_size", self.dispatch_buffer_size)
            if self.dispatch_buffer_size == 0:
                raise ValueError(
                    "dispatch_buffer_size must be >= 1 (items each worker may hold from the dispatch "
                    "process), or None to follow worker_prefetch_cnt"
                )
        if not isinstance(self.in_order, bool):
            raise TypeError(f"in_order must be True or False, got {type(self.in_order).__name__}")
        methods = multiprocessing.get_all_start_methods()
        if self.multiprocessing_context is not None and self.multiprocessing_context not in methods:
            raise ValueError(
                f"multiprocessing_context={self.multiprocessing_context!r} is not a start method of this "
                f"platform; choose one of {methods} or None for the default"
            )
        for name in ("worker_init_fn", "worker_reset_fn", "dispatch_init_fn"):
            hook = getattr(self, name)
            if hook is not None and not callable(hook):
                raise TypeError(f"{name} must be callable or None, got {type(hook).__name__}")

    @property
    def timeline_capacity(self) -> int:
        """Records kept per lane of the timeline; 0 when none is recorded."""
        if self.timeline is True:
            from .runtime.timeline import DEFAULT_CAPACITY

            return DEFAULT_CAPACITY
        return int(self.timeline)

    @property
    def items_in_flight_per_worker(self) -> int:
        """Capacity, in items, of each worker's channel to the main process.

        Prefetching happens in the channels themselves, without a thread: each worker may
        run ``worker_prefetch_cnt`` items ahead, and the main process's share of
        ``main_prefetch_cnt`` is spread over the workers' channels.
        """
        share = -(-self.main_prefetch_cnt // max(self.num_workers, 1))
        return max(1, self.worker_prefetch_cnt + share)

    @property
    def dispatch_channel_items(self) -> int:
        """Capacity, in items, of each channel from the dispatch process to a worker:
        ``dispatch_buffer_size``, or by default ``worker_prefetch_cnt`` (at least 1)."""
        if self.dispatch_buffer_size is not None:
            return self.dispatch_buffer_size
        return max(1, self.worker_prefetch_cnt)


def _non_negative_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")