"""The item window (``runtime/window.py``) alone, in this process: permits taken one per item,
returned one per item handed out, reset to the window's size by a new epoch; a lane that has
none flushes what it holds and waits only until it is interrupted."""

import multiprocessing
import threading

import pytest

from mprs_plus.runtime.window import ItemWindow

pytestmark = pytest.mark.timeout(30)


def never():
    return False


def test_a_lane_takes_as_many_permits_as_the_window_then_one_per_item_handed_out():
    window = ItemWindow(multiprocessing.get_context("fork"), 2)
    flushed = []
    assert window.take(lambda: flushed.append(1), never) and window.take(lambda: flushed.append(1), never)
    assert flushed == []  # permits at hand: nothing to flush
    assert window.take(lambda: flushed.append(1), lambda: True) is False  # none left: flush, then interrupted
    assert flushed == [1]
    window.handed()
    assert window.take(lambda: flushed.append(1), never)
    assert flushed == [1]


def test_a_waiting_lane_goes_on_when_an_item_is_handed_out():
    window = ItemWindow(multiprocessing.get_context("fork"), 1)
    assert window.take(lambda: None, never)
    flushed, taken = threading.Event(), []
    waiter = threading.Thread(target=lambda: taken.append(window.take(flushed.set, never)))
    waiter.start()
    assert flushed.wait(10)  # it flushed before waiting
    window.handed()
    waiter.join(10)
    assert taken == [True]


def test_a_new_epoch_has_the_window_size_whatever_the_last_one_left():
    window = ItemWindow(multiprocessing.get_context("fork"), 3)
    for _ in range(5):
        window.handed()  # more returned than taken (an epoch abandoned by the reader)
    window.reopen()
    assert [window.take(lambda: None, never) for _ in range(3)] == [True] * 3
    assert window.take(lambda: None, lambda: True) is False
    window.reopen()  # none left: full again
    assert [window.take(lambda: None, never) for _ in range(3)] == [True] * 3
