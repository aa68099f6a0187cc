"""What every child process does first, before it runs its segment.

    * ignore SIGINT: Ctrl-C reaches the whole process group, but only the main process
      decides to stop; children then end when their control channel closes, instead
      of printing tracebacks;
    * watch its parent: a daemon thread waits on the parent's sentinel and exits the
      child at once when the parent is gone, so a killed main process leaves no orphans;
    * drop inherited channel endpoints it does not own (fork), so that a dead peer
      shows as a broken pipe;
    * run torch's intra-op pool on one thread: N children each running the default pool
      would oversubscribe the cores;
    * pin glibc's allocator thresholds (``allocator.py``): a process whose thresholds
      settled low maps and unmaps fresh pages for every large sample it makes;
    * freeze what it inherited out of the garbage collector's reach (``gc.freeze``), so
      that no collection copies the parent's heap into it.

How the main process ends children is ``main/lifecycle.py``.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterable
from multiprocessing.connection import wait
from ...transport import Endpoint, release_all_except
from .allocator import pin_thresholds


def child_setup(own_endpoints: Iterable[Endpoint]) -> None:
    if threading.current_thread() is threading.main_thread():  # a Ray actor runs its child in a thread
        # Every object this process has now (a forked child: all of the parent's) leaves
        # the garbage collector's reach: a collection would otherwise visit each of them,
        # writing to its header, and the kernel would copy every page they lie on into
        # this process, a dataset of Python objects included (~100 ms and a copy of the
        # parent's heap per worker start). Objects made from here on are collected as usual.
        gc.freeze()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # Started with SIGINT blocked (backends/local.py): one that came since is dropped now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        pin_thresholds()  # a process of our own (a Ray actor's allocator is Ray's)
    release_all_except(own_endpoints)
    _limit_intra_op_threads()
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_when_parent_dies, args=(parent.sentinel,), daemon=True).start()


def _limit_intra_op_threads() -> None:
    # N workers each running torch's default thread pool would oversubscribe the cores.
    try:
        import torch

        torch.set_num_threads(1)
    except Exception:  # pragma: no cover - torch is a dependency, but never fail a worker over it
        pass


def _exit_when_parent_dies(sentinel: int) -> None:
    wait([sentinel])
    os._exit(0)
