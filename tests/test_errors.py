"""Errors from a child read as torch's and torchdata's do: same type, ``str()`` holding
"Caught <Type> in worker process N", "Original Traceback" and the original last line.

Driven in-process: ``RemoteError`` is captured and rebuilt exactly as it would be across
processes (it travels pickled).
"""

from __future__ import annotations

import pickle

import pytest

from mprs_plus import WorkerError
from mprs_plus.runtime.data_messages import RemoteError, describe_process
from mprs_plus.segment import Segment


class CustomError(Exception):
    pass


class WithField(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = 7


class KeywordOnly(Exception):
    """Pickles (its reduce says how), but cannot be built from one message."""

    def __init__(self, *, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason

    def __reduce__(self):
        return _keyword_only, (self.reason,)


def _keyword_only(reason: str) -> KeywordOnly:
    return KeywordOnly(reason=reason)


def _raise(exc: BaseException) -> None:
    raise exc


def travelled(exc: BaseException, where: str) -> BaseException:
    try:
        _raise(exc)
    except BaseException as raised:
        error = RemoteError.capture(raised, where)
    return pickle.loads(pickle.dumps(error)).rebuild()


def test_same_type_with_torchs_message():
    exc = travelled(CustomError("oops"), describe_process(Segment.WORKER, 0))
    assert type(exc) is CustomError
    text = str(exc)
    assert text.startswith("Caught CustomError in worker process 0 (pid ")
    assert "\nOriginal Traceback (most recent call last):\n" in text
    assert "in _raise" in text
    assert text.endswith("CustomError: oops")


def test_dispatching_process_is_named_as_torchdata_names_it():
    exc = travelled(CustomError("oops"), describe_process(Segment.DISPATCH))
    assert "Caught CustomError in dispatching process" in str(exc)


def test_key_error_text_is_not_quoted():
    exc = travelled(KeyError("missing"), describe_process(Segment.WORKER, 2))
    assert type(exc) is KeyError
    assert str(exc).startswith("Caught KeyError in worker process 2")
    assert "\\n" not in str(exc)  # newlines are real, not escaped by KeyError's repr


def test_attributes_of_the_original_are_kept():
    exc = travelled(WithField("bad"), describe_process(Segment.WORKER, 0))
    assert type(exc) is WithField and exc.code == 7


def test_a_type_that_takes_no_single_message_is_the_original_with_the_text_in_a_note():
    exc = travelled(KeywordOnly(reason="why"), describe_process(Segment.WORKER, 1))
    assert type(exc) is KeywordOnly and exc.reason == "why"
    assert any(note.startswith("Caught KeywordOnly in worker process 1") for note in exc.__notes__)


def test_a_type_the_main_process_cannot_import_becomes_worker_error():
    error = RemoteError.capture(CustomError("lost"), describe_process(Segment.WORKER, 0))
    error = error._replace(type_pickled=None, pickled=None)  # as if neither unpickles
    exc = error.rebuild()
    assert type(exc) is WorkerError and isinstance(exc, RuntimeError)
    assert str(exc).startswith("Caught CustomError in worker process 0")


def test_note_names_the_process():
    exc = travelled(CustomError("oops"), describe_process(Segment.WORKER, 3))
    assert any("raised in worker process 3 (pid" in note for note in exc.__notes__)


@pytest.mark.parametrize("exc", [ValueError("v"), TypeError("t"), StopIteration(), OSError(2, "gone")])
def test_builtin_types_survive(exc):
    rebuilt = travelled(exc, describe_process(Segment.WORKER, 0))
    assert type(rebuilt) is type(exc)


def test_an_error_passed_on_by_another_child_still_names_where_it_happened():
    # A dispatch error reaches the main process through a worker, which raises it again.
    arrived = travelled(CustomError("oops"), describe_process(Segment.DISPATCH))
    again = RemoteError.capture(arrived, describe_process(Segment.WORKER, 1))
    exc = pickle.loads(pickle.dumps(again)).rebuild()
    assert str(exc).startswith("Caught CustomError in dispatching process")
    assert "worker process" not in str(exc)
    assert len([note for note in exc.__notes__ if note.startswith("(raised in")]) == 1
