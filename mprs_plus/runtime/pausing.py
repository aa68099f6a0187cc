"""Pause and resume the DataPipes of one segment, wherever it runs (main process or child).

    pause    pause() every DataPipe that has one, in graph order (outermost first)
    resume   resume() every DataPipe that has one, in reverse graph order

as torchdata's own reading services do, so that a DataPipe with a thread of its own
(``fullsync``, ``prefetch``) stops before what feeds it and starts after it.
"""

from __future__ import annotations

from typing import Any


def pause_datapipes(root: Any) -> None:
    from torchdata.dataloader2.graph import list_dps, traverse_dps  # loaded where used: see plan._is_dispatcher

    for datapipe in list_dps(traverse_dps(root)):
        if callable(getattr(datapipe, "pause", None)):
            datapipe.pause()


def resume_datapipes(root: Any) -> None:
    from torchdata.dataloader2.graph import list_dps, traverse_dps

    for datapipe in reversed(list_dps(traverse_dps(root))):
        if callable(getattr(datapipe, "resume", None)):
            datapipe.resume()
