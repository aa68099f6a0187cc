"""What a Ray test asks the cluster about its actors, shared by the Ray test modules."""

from __future__ import annotations

import threading
from collections.abc import Callable


def alive_actors() -> list[str]:
    """The actors Ray does not report dead, asked in a helper thread: the control store's
    client waits in native code, where pytest-timeout's signal cannot end a wait."""
    from ray._private.state import actors

    answer: list[list[str]] = []
    helper = threading.Thread(
        target=lambda: answer.append([a for a, info in actors().items() if info["State"] != "DEAD"]), daemon=True
    )
    helper.start()
    helper.join(60.0)
    assert answer, "Ray's control store did not list the actors within 60 s"
    return answer[0]


def end_warm_actors_and_check_none_left(detail: Callable[[], str] = lambda: "") -> None:
    """After a test on a cluster: the actors its loaders gave back wait for a next loader
    (``RayBackend.warm_for``); end them as ``RayBackend.close()`` does (it waits until Ray
    reports each killed actor dead), so that each test starts from none, and check that
    none is left. ``detail()``: what the failure message adds (asked on a failure only)."""
    from mprs_plus.backends.ray import warm

    warm.pool.close()
    assert warm.pool.idle() == 0
    left = alive_actors()
    assert left == [], f"actors left behind{detail()}"

