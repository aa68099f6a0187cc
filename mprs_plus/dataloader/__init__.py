"""``mprs_plus.DataLoader``: the front end with torch's ``DataLoader`` API.

    loader.py     the class: torch's constructor and attributes, stats, explain, checkpoints
    iterator.py   one epoch: in this process or read from the workers; what the loop received
    epochs.py     the main process's draws (base seed, sampler), in torch's order
    stage.py      what each worker runs: torch's worker protocol as one DataPipe
    workers.py    the runtime of the workers, and the feeding to a device
    state.py      the checkpoint's contents and its checks
    errors.py     the runtime's errors as torch raises them

The class sits on top: it hands each epoch what the epoch reads of it (``EpochSettings``)
and what epochs share (``LoaderKeep``); no module here imports loader.py
(``tests/test_architecture.py`` checks it).

A front end, like the reading service: it builds a plan for the one runtime
(``runtime/``) and learns nothing of its processes and channels.
"""

from __future__ import annotations

from .loader import DataLoader

__all__ = ["DataLoader"]
