"""The loader's checkpoint: a small dict, cheap to take after every batch.

    start           what drew the epoch (``epochs.EpochStart``): generator state, sampler
                    states, base seed. Taken once per epoch; every state of that epoch
                    refers to the same one.
    consumed        batches handed out per worker (the runtime's read cursor), or in
                    total with num_workers=0
    next_worker     whose turn is next (in order)
    worker_states   an iterable dataset's recorded states: worker -> (its batch count, state)
    shape           dataset kind and length, batch size, drop_last, worker count, seeding:
                    a state restores only into a loader built the same way (else
                    ValueError); with seeding="batch", the worker count may differ
    layout          seeding="batch": the epoch's batches still to make when it began
                    (``elastic.Layout``; absent: all of them), which ``consumed`` counts in
    distributed     with a DistributedSampler: its epoch as one global order, the world
                    size it is split over, and the samples made before (``elastic.Remainder``)
    world_size      the world size the epoch was split over: a restore at another is
                    refused unless ``distributed`` says how to split the rest

Everything in it is plain data (ints, lists, dicts, and what the samplers' and datasets'
own ``state_dict()`` return), so it goes through ``torch.save`` and, where those do, JSON.

A restore draws the epoch again from ``start`` and has each worker skip its consumed
batches (map-style: the index batches, unread), the runtime's restore mechanism
(``runtime/main/restore.py``): exact, the same batches and worker seeds as the
uninterrupted run. With ``seeding="batch"`` the counts are folded into positions of the
epoch instead (``adapt``): what is left is dealt anew over any worker count, and over any
world size of a ``DistributedSampler``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from torch.utils.data.dataloader import _DatasetKind

from .batch_seeds import BATCH, WORKER, batch_shard, distributed_sampler
from .elastic import SAMPLES, Layout, Remainder, batches_of
from .epochs import EpochStart, has_len

RUNNING = "running"
BETWEEN = "between_epochs"
_FORMAT = "mprs_plus.DataLoader/1"


def shape(loader: Any) -> dict[str, Any]:
    """What a state restores only into: the loader's dataset kind and length, batch size,
    ``drop_last``, worker count."""
    try:
        length = len(loader.dataset)
    except TypeError:
        length = None
    return {
        "dataset_kind": "iterable" if loader._dataset_kind == _DatasetKind.Iterable else "map",
        "dataset_length": length,
        "batch_size": loader.batch_size,
        "drop_last": loader.drop_last,
        "num_workers": getattr(loader, "_workers_now", loader.num_workers),  # "auto": the count it runs
        "seeding": getattr(loader, "seeding", WORKER),
    }


def running(
    loader_shape: dict[str, Any], start: EpochStart, consumed: list[int], next_worker: int, worker_states: dict[int, tuple[int, Any]]
) -> dict[str, Any]:
    return {
        "format": _FORMAT,
        "phase": RUNNING,
        "shape": loader_shape,
        "start": start.to_dict(),
        "consumed": consumed,
        "next_worker": next_worker,
        "worker_states": worker_states,
    }


def between(loader: Any, start: EpochStart, worker_states: dict[int, tuple[int, Any]] | None = None) -> dict[str, Any]:
    """Before an epoch: what the next epoch's draws start from, and the datasets' states
    that persistent workers carry into it."""
    return {
        "format": _FORMAT,
        "phase": BETWEEN,
        "shape": shape(loader),
        "start": start.to_dict(),
        "consumed": [],
        "next_worker": 0,
        "worker_states": dict(worker_states or {}),
    }


def skipping(state: dict[str, Any], batches: int) -> dict[str, Any]:
    """``state`` (taken between epochs) moved ``batches`` batches into the epoch it begins,
    as if the loop had received them: a restore has each worker re-read its share of them
    (batch i is worker i % N's, as the epoch deals them) and goes on with batch ``batches``,
    exactly. For a library's "skip the first n batches" (Accelerate's ``skip_first_batches``)
    that must not shift the workers' random draws. Map-style datasets only: an iterable
    dataset's batches are not dealt, they are skipped by reading them."""
    if state.get("phase") != BETWEEN:
        raise ValueError("internal error: batches can only be skipped from a state taken between epochs")
    if state["shape"]["dataset_kind"] != "map":
        raise ValueError("internal error: skipping batches by a state needs a map-style dataset")
    workers = max(state["shape"]["num_workers"], 1)
    consumed = [len(range(w, batches, workers)) for w in range(workers)]
    return {**state, "phase": RUNNING, "consumed": consumed, "next_worker": batches % workers}


def check(loader: Any, state: Any) -> dict[str, Any]:
    """``state`` if it restores into ``loader``; else a ValueError saying what differs."""
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise ValueError(
            "load_state_dict() expects a state from mprs_plus.DataLoader.state_dict(); this one is not "
            "(a state of another loader class cannot be resumed exactly)"
        )
    expected, recorded = shape(loader), {"seeding": WORKER, **state["shape"]}
    differences = [
        f"{name} {recorded.get(name)!r} in the state, {value!r} here"
        for name, value in expected.items()
        if recorded.get(name) != value and name != "num_workers"
    ]
    if differences:
        raise ValueError(
            "this state was taken of a loader built differently: "
            + "; ".join(differences)
            + ". Restore it into a loader with the same dataset, batch size and seeding."
        )
    # A state that went through JSON has its worker numbers as strings, its pairs as lists.
    state = {**state, "worker_states": {int(w): tuple(v) for w, v in state["worker_states"].items()}}
    if recorded["num_workers"] != expected["num_workers"]:
        _check_other_count(loader, state, recorded["num_workers"], expected["num_workers"])
    if state["phase"] == RUNNING:
        check_world(loader, state)
    return state


def _check_other_count(loader: Any, state: dict[str, Any], recorded: int, workers: int) -> None:
    """A state taken with another worker count: restorable with seeding="batch" only, and
    only where nothing in it belongs to one worker."""
    taken = f"this state was taken of a loader built differently: num_workers {recorded} in the state, {workers} here"
    if getattr(loader, "seeding", WORKER) != BATCH:
        raise ValueError(
            f"{taken}: with seeding=\"worker\" (torch's: worker k seeded with base_seed + k) the batches depend "
            "on the count. Restore with the same num_workers, or build both loaders with seeding=\"batch\", "
            "whose states restore at any count (docs/elastic-workers.md)"
        )
    if max(recorded, workers) <= 1:
        # One replica either way: the loop's own process is worker 0 of 1 (the same shard, the
        # same dataset state, the same seeds), so a state of each restores at the other.
        return
    if state["worker_states"]:
        raise ValueError(
            f"{taken}: it holds each worker's own dataset state (the dataset's state_dict()), which cannot be "
            "split over another count. Restore with the same num_workers"
        )
    if state["phase"] != RUNNING:
        return
    if loader._dataset_kind == _DatasetKind.Iterable:
        raise ValueError(
            f"{taken}: an iterable dataset shards itself by worker (get_worker_info()), so its position is each "
            "worker's own. Restore mid-epoch with the same num_workers (a state between epochs restores at any count)"
        )
    if not has_len(loader._index_sampler):
        raise ValueError(
            f"{taken}: a sampler without len() is drawn in the workers, a worker's share at a time. Restore "
            "mid-epoch with the same num_workers (a state between epochs restores at any count)"
        )


class Adapted(NamedTuple):
    """A running state made ready for this loader's epoch (``adapt``)."""

    state: dict[str, Any]  # with the counts over this loader's deal
    layout: Layout  # the epoch's batches still to make
    batches: Callable[[], list[Any]] | None  # the epoch's index batches, where a Remainder makes them (else the sampler's)
    remainder: Remainder | None  # a sharded epoch, as later states record it


def adapt(loader: Any, state: dict[str, Any]) -> Adapted:
    """A running state (checked) made ready for ``loader``'s epoch.

    - A sharding (``DistributedSampler``, Accelerate's ``BatchSamplerShard``) whose world
      size is not the state's (or whose epoch is already a remainder): the rank's batches
      made are folded into the global order, and what is left of it is split over this
      world (``Remainder``).
    - ``seeding="batch"`` and no dataset state of a worker's own: the counts are folded
      into a ``Layout`` (nothing needs replaying; any worker count deals what is left).
    - Otherwise the state as it is: the workers skip their counts, as recorded."""
    workers = max(getattr(loader, "_workers_now", loader.num_workers), 1)  # "auto": the count it runs
    recorded = max(state["shape"]["num_workers"], 1)
    layout = Layout.from_dict(state.get("layout"))
    remainder = Remainder.from_dict(state.get("distributed"))
    fresh = {**state, "consumed": [0] * workers, "next_worker": 0}
    sharding = splitter(loader, remainder)
    if remainder is not None and sharding is not None and (remainder.world != sharding[0] or remainder.done):
        world, rank, order = sharding
        if state["worker_states"]:
            raise ValueError(
                f"this state was taken at a world size of {remainder.world}, this rank's loader has {world}: it "
                "holds the dataset's own state of each worker, which cannot be split over other ranks. Restore at "
                "the same world size"
            )
        left = layout.fold(recorded, state["consumed"])
        if left.done:
            raise ValueError(
                "this state's batches were handed out of order (in_order=False), so the ranks made different "
                "samples: it restores at another world size only when taken in order. Restore at the same world size"
            )
        remainder = remainder.taken_over(left.start, loader.batch_size or 1, world)
        if remainder.unit == SAMPLES:
            size, drop_last, taken = loader.batch_size, loader.drop_last, remainder

            def batches() -> list[Any]:
                return batches_of(taken.indices(rank), size, drop_last)
        else:
            taken = remainder

            def batches() -> list[Any]:  # drawn after the epoch's base seed, as the sampler's own draws are
                return taken.split(order(), rank)

        return Adapted(fresh, Layout(), batches, remainder)
    check_world(loader, state)
    if getattr(loader, "seeding", WORKER) == BATCH and not state["worker_states"] and recorded_by_position(loader):
        return Adapted(fresh, layout.fold(recorded, state["consumed"]), None, remainder)
    return Adapted(state, layout, None, remainder)


def splitter(loader: Any, remainder: Remainder | None) -> tuple[int, int, Callable[[], list[Any]]] | None:
    """(world size, rank, the epoch's global order) of the loader's sharding where it can
    split ``remainder``'s kind: a ``DistributedSampler`` batched by the loader, or
    Accelerate's ``BatchSamplerShard`` of whole batches; else None."""
    if remainder is None:
        return None
    if remainder.unit == SAMPLES:
        sampler = distributed_sampler(loader.sampler, loader.batch_sampler)
        if sampler is None or loader.batch_size is None or getattr(loader.batch_sampler, "sampler", None) is not sampler:
            return None
        return int(sampler.num_replicas), int(sampler.rank), remainder.order
    shard = batch_shard(loader.batch_sampler)
    if shard is None:
        return None
    inner = shard.batch_sampler
    return int(shard.num_processes), int(shard.process_index), lambda: list(inner)


def check_world(loader: Any, state: dict[str, Any]) -> None:
    """A running state of another world size restores only by its ``Remainder`` (a
    ``DistributedSampler`` then and now); else a ValueError."""
    from torch.utils.data.dataloader import _get_distributed_settings

    sampler = distributed_sampler(loader.sampler, loader.batch_sampler)
    if splitter(loader, Remainder.from_dict(state.get("distributed"))) is not None:
        return  # adapt() splits the rest over this world
    shard = batch_shard(loader.batch_sampler)
    if sampler is not None:
        world = int(sampler.num_replicas)
    elif shard is not None:
        world = int(shard.num_processes)
    else:
        world = _get_distributed_settings()[0]
    if state.get("world_size") is not None and state["world_size"] != world:
        raise ValueError(
            f"this state was taken at a world size of {state['world_size']}, this process is one of {world}: another "
            "world size is resumed for torch's DistributedSampler batched by the loader, and for Accelerate's "
            "BatchSamplerShard of whole batches, only (their epoch is one global order; another sharding's is not "
            "known here). Restore at the same world size"
        )


def recorded_by_position(loader: Any) -> bool:
    """Whether the loader's epochs are dealt by positions here: a map-style dataset whose
    sampler has a len()."""
    return loader._dataset_kind == _DatasetKind.Map and has_len(loader._index_sampler)
