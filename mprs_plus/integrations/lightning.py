"""Lightning: the loader's figures in the trainer's logger.

    from mprs_plus.integrations.lightning import StatsLogger
    trainer = lightning.Trainer(callbacks=[StatsLogger(every_n_steps=50)])

Every ``every_n_steps`` training steps, ``StatsLogger`` finds the ``mprs_plus.DataLoader``
(or the ``DataLoader2`` running ``MultiProcessingReadingService``) the trainer iterates,
and logs its ``stats().scalars()`` with ``LightningModule.log_dict``: items/s, the loop's
wait share, the workers' busy share, replacements, private memory, to whatever logger the
trainer has (TensorBoard, W&B, CSV). It finds the loader on the trainer each time:
Lightning re-creates loaders (a sampler of its own for DDP), so the one the user made is
not the one that runs.

A callback only, through Lightning's public ``Callback`` hooks and ``log_dict``; it
changes nothing in the run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package
    try:
        from pytorch_lightning import Callback
    except ImportError as exc:
        raise ImportError(
            "mprs_plus.integrations.lightning needs Lightning: pip install lightning (or pytorch-lightning)"
        ) from exc


class StatsLogger(Callback):  # type: ignore[misc]
    """Log the training loader's ``stats().scalars(prefix)`` every ``every_n_steps`` steps."""

    def __init__(self, every_n_steps: int = 50, prefix: str = "mprs_plus/") -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an int >= 1, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.prefix = prefix

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % self.every_n_steps:
            return
        for stats in _stats_of(getattr(trainer, "train_dataloader", None)):
            pl_module.log_dict(stats.scalars(self.prefix), on_step=True, on_epoch=False)
            return  # one loader's figures: several would log under the same names


def _stats_of(loaders: Any) -> Iterator[Any]:
    """The statistics of every mprs_plus loader in ``loaders`` (one, or lists and dicts of them)."""
    from ..dataloader import DataLoader
    from ..reading_service import MultiProcessingReadingService

    if isinstance(loaders, DataLoader):
        yield loaders.stats()
    elif isinstance(getattr(loaders, "reading_service", None), MultiProcessingReadingService):
        yield loaders.reading_service.stats()  # DataLoader2 (the one it runs reports through it)
    elif isinstance(loaders, dict):
        for value in loaders.values():
            yield from _stats_of(value)
    elif isinstance(loaders, (list, tuple)):
        for value in loaders:
            yield from _stats_of(value)
