"""What a Ray test asks the cluster about its actors, shared by the Ray test modules."""

from __future__ import annotations

import threading


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
