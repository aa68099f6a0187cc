"""The loader's checkpoint: a small dict, cheap to take after every batch.

    start           what drew the epoch (``epochs.EpochStart``): generator state, sampler
                    states, base seed. Taken once per epoch; every state of that epoch
                    refers to the same one.
    consumed        batches handed out per worker (the runtime's read cursor), or in
                    total with num_workers=0
    next_worker     whose turn is next (in order)
    worker_states   an iterable dataset's recorded states: worker -> (its batch count, state)
    shape           dataset kind and length, batch size, drop_last, worker count: a state
                    restores only into a loader built the same way (else ValueError)

Everything in it is plain data (ints, lists, dicts, and what the samplers' and datasets'
own ``state_dict()`` return), so it goes through ``torch.save`` and, where those do, JSON.

A restore draws the epoch again from ``start`` and has each worker skip its consumed
batches (map-style: the index batches, unread), the runtime's restore mechanism
(``runtime/main/restore.py``): exact, the same batches and worker seeds as the
uninterrupted run.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data.dataloader import _DatasetKind

from .epochs import EpochStart

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
    expected, recorded = shape(loader), state["shape"]
    differences = [
        f"{name} {recorded.get(name)!r} in the state, {value!r} here"
        for name, value in expected.items()
        if recorded.get(name) != value
    ]
    if differences:
        raise ValueError(
            "this state was taken of a loader built differently: "
            + "; ".join(differences)
            + ". Restore it into a loader with the same dataset, batch size and workers."
        )
    # A state that went through JSON has its worker numbers as strings, its pairs as lists.
    return {**state, "worker_states": {int(w): tuple(v) for w, v in state["worker_states"].items()}}
