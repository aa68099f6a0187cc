"""Whatever a worker's code raises reaches the user as an error from that worker, never as
a process death, and keeps its type and fields as ``num_workers=0`` shows them.

Real processes (fork: the DataPipe hooks' rewritten ``args`` then name the same objects in
both runs). Each case reads one small epoch; the autouse leak check covers the children.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from mprs_plus import MultiProcessingReadingService, ProcessDiedError, WorkerError

BAD = 3  # the item that raises; worker 1 of 2 maps it


class BrokenStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("this exception cannot say what it is")


def _raise(kind: str) -> None:
    if kind == "GeneratorExit":
        raise GeneratorExit("closed by hand")
    if kind == "KeyboardInterrupt":
        raise KeyboardInterrupt
    if kind == "SystemExit":
        raise SystemExit("msg")
    if kind == "FileNotFoundError":
        open("/nonexistent-mprs-plus-test/file")
    if kind == "CalledProcessError":
        subprocess.run([sys.executable, "-c", "raise SystemExit(3)"], check=True)
    if kind == "UnicodeDecodeError":
        b"ab\xff".decode("utf-8")
    if kind == "BrokenStr":
        raise BrokenStr()
    raise AssertionError(kind)


def fail_on(kind: str, x: int) -> int:
    if x == BAD:
        _raise(kind)
    return x


def _caught(kind: str, num_workers: int, where: str = "map", context: str = "fork") -> BaseException:
    pipe = IterableWrapper(range(8)).sharding_filter()
    options = {}
    if where == "map":
        pipe = pipe.map(functools.partial(fail_on, kind))
    else:
        options["worker_init_fn"] = functools.partial(_init_raises, kind)
    rs = MultiProcessingReadingService(num_workers=num_workers, multiprocessing_context=context, **options)
    loader = DataLoader2(pipe, reading_service=rs if num_workers else None)
    try:
        list(loader)
    except BaseException as exc:  # noqa: B036 - what the user would get, BaseException included
        return exc
    finally:
        loader.shutdown()
    raise AssertionError(f"{kind} was not raised")


def _init_raises(kind: str, datapipe, info):
    if info.worker_id == 1:
        _raise(kind)
    return datapipe


@pytest.mark.parametrize("kind", ["GeneratorExit", "KeyboardInterrupt", "SystemExit"])
def test_a_base_exception_from_a_workers_function_is_reported_as_torch_reports_errors(kind):
    exc = _caught(kind, 2)
    assert not isinstance(exc, ProcessDiedError)
    # Raised as itself here, it would mean the end of this process, a Ctrl-C, or a closed generator.
    assert type(exc) is WorkerError
    text = str(exc)
    assert text.startswith(f"Caught {kind} in worker process 1 (pid ")
    assert "\nOriginal Traceback (most recent call last):\n" in text
    assert "in fail_on" in text and "in _raise" in text
    assert text.splitlines()[-1].startswith(kind)
    if kind == "SystemExit":
        assert text.endswith("SystemExit: msg")


def test_spawned_worker_reports_system_exit_too():
    exc = _caught("SystemExit", 2, context="spawn")
    assert type(exc) is WorkerError and str(exc).startswith("Caught SystemExit in worker process 1")


def test_a_base_exception_from_worker_init_fn_is_reported_too():
    exc = _caught("SystemExit", 2, where="init")
    assert type(exc) is WorkerError and str(exc).startswith("Caught SystemExit in worker process 1")
    assert "in _init_raises" in str(exc)


def _text_of(exc: BaseException) -> str:
    """What a printed traceback shows after the type: str() (or its failure) and the notes."""
    return "\n".join(getattr(exc, "__notes__", []))


def test_os_errors_keep_errno_strerror_and_filename():
    local, remote = _caught("FileNotFoundError", 0), _caught("FileNotFoundError", 2)
    assert type(remote) is FileNotFoundError
    for field in ("errno", "strerror", "filename", "filename2"):
        assert getattr(remote, field) == getattr(local, field), field
    assert str(remote) == str(local)  # the fields make OSError's str(): the torch text is a note
    assert _text_of(remote).startswith("Caught FileNotFoundError in worker process 1 (pid ")


def test_called_process_error_keeps_its_type_and_fields():
    local, remote = _caught("CalledProcessError", 0), _caught("CalledProcessError", 2)
    assert type(remote) is subprocess.CalledProcessError
    for field in ("returncode", "cmd", "output", "stderr", "args"):
        assert getattr(remote, field) == getattr(local, field), field
    assert str(remote) == str(local)
    assert "Caught CalledProcessError in worker process 1" in _text_of(remote)


def test_unicode_errors_keep_their_fields_args_and_str():
    local, remote = _caught("UnicodeDecodeError", 0), _caught("UnicodeDecodeError", 2)
    assert type(remote) is UnicodeDecodeError
    for field in ("encoding", "object", "start", "end", "reason", "args"):
        assert getattr(remote, field) == getattr(local, field), field
    assert str(remote) == str(local) == "'utf-8' codec can't decode byte 0xff in position 2: invalid start byte"
    assert "Caught UnicodeDecodeError in worker process 1" in _text_of(remote)


def test_an_exception_whose_str_raises_is_an_error_from_the_worker_not_a_death():
    exc = _caught("BrokenStr", 2)
    assert type(exc) is BrokenStr
    assert _text_of(exc).startswith("Caught BrokenStr in worker process 1 (pid ")
    assert "<exception str() failed>" in _text_of(exc)
