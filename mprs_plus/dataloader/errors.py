"""Errors of the runtime as torch's DataLoader raises them: its types, its wording.

    a worker's exception     its own type, "Caught ValueError in DataLoader worker process 1."
                             and the original traceback (torch's ``ExceptionWrapper`` wording)
    a worker that died       RuntimeError "DataLoader worker (pid 4242) is killed by signal: ..."
                             (a signal), else "DataLoader worker (pid(s) 4242) exited unexpectedly"
    code a node cannot load  RuntimeError with what the backend says (which module, how to ship it)
    timeout= expired         RuntimeError "DataLoader timed out after 5 seconds"
    the service stopped      RuntimeError saying so

The runtime's own types (``ProcessDiedError``, ...) never reach the loop of a user who
switched from torch's loader: code written for torch's errors keeps working.
"""

from __future__ import annotations

import re
import signal

from ..errors import PipelineStuckError, ProcessDiedError, ServiceClosedError
from ..runtime.data_messages import _ORIGIN, RemoteError

_WORKER = re.compile(r"worker process (\d+)")
_CHILD = re.compile(r"(?:mprs_plus )?worker(?: process)? (\d+)")  # a child as the runtime names it
_PID = re.compile(r"pid (\d+)")
_SIGNAL = re.compile(r"killed by (SIG[A-Z0-9]+)")


def _describe(name: str) -> str:
    try:
        return signal.strsignal(signal.Signals[name]) or name
    except (KeyError, ValueError):
        return name


def torch_error(exc: BaseException, timeout: float) -> BaseException | None:
    """The exception to raise instead of ``exc``, or None to raise ``exc`` as it is."""
    origin = getattr(exc, _ORIGIN, None)
    if isinstance(origin, RemoteError):
        found = _WORKER.match(origin.where)
        where = f"DataLoader worker process {found.group(1)}" if found else origin.where
        rebuilt = origin._replace(where=where).rebuild()
        rebuilt.__traceback__ = None
        return rebuilt
    if isinstance(exc, ProcessDiedError):
        detail = str(exc).split(". The reading service cannot continue", 1)[0]
        if exc.explained:  # what happened is known (code a node cannot load): said as it is
            detail = _CHILD.sub(r"DataLoader worker process \1", detail).replace("the pipeline's code", "its code")
            return RuntimeError(f"{detail}. Then iterate the loader again to start new workers.")
        pids = _PID.findall(detail)
        advice = (
            f"{detail}. Look for an out-of-memory kill, a call to os._exit or a crash in native code in that "
            "worker (its stderr may say more); iterate the loader again to start new workers."
        )
        killed = _SIGNAL.search(detail)
        if killed is not None and len(pids) == 1:  # torch's words for a worker ended by a signal
            return RuntimeError(f"DataLoader worker (pid {pids[0]}) is killed by signal: {_describe(killed.group(1))}. {advice}")
        return RuntimeError(f"DataLoader worker (pid(s) {', '.join(pids) or 'unknown'}) exited unexpectedly: {advice}")
    if isinstance(exc, TimeoutError):
        return RuntimeError(f"DataLoader timed out after {timeout} seconds")
    if isinstance(exc, ServiceClosedError):
        return RuntimeError(
            "this DataLoader iterator's workers were stopped (an earlier error, or load_state_dict() on its "
            "loader): iterate the loader again to start new ones"
        )
    if isinstance(exc, PipelineStuckError):
        return RuntimeError(str(exc))
    return None


def is_fatal(exc: BaseException) -> bool:
    """Whether the workers cannot go on after ``exc`` (not a worker's own exception)."""
    return not isinstance(getattr(exc, _ORIGIN, None), RemoteError)
