"""Test helpers that watch the runtime from inside the main process."""

from __future__ import annotations

from mprs_plus.runtime import liveness


def record_liveness_tables(monkeypatch) -> list[liveness.Liveness]:
    """The liveness tables made from now on (one per service started), in order: a test
    reads from them when every child lane has slept in a channel wait."""
    made: list[liveness.Liveness] = []
    real_init = liveness.Liveness.__init__

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(liveness.Liveness, "__init__", recording_init)
    return made
