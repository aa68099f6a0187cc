"""Run the ranks of a gloo process group on 127.0.0.1 as subprocesses of a test.

    run_ranks(script, world_size, args_of)   start one process per rank, wait for all,
                                             fail with the log of any rank that failed

Every rank gets the same free loopback port and ``GLOO_SOCKET_IFNAME=lo``; a rank still
running when another has failed or after ``timeout`` is killed, so nothing outlives the test.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    script: pathlib.Path, world_size: int, args_of: Callable[[int, int], list[str]], timeout: float = 100
) -> None:
    """Run ``script`` once per rank with ``args_of(rank, port)`` as its arguments."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    port = free_port()
    processes = [
        subprocess.Popen(
            [sys.executable, str(script), *args_of(rank, port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]
    logs = []
    try:
        for process in processes:
            logs.append(process.communicate(timeout=timeout)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    for rank, (process, log) in enumerate(zip(processes, logs)):
        assert process.returncode == 0, f"rank {rank}:\n{log[-4000:]}"
