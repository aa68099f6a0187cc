"""The policy of num_workers="auto" alone (``mprs_plus/autoscale.py``): windows of figures
in, counts out. No process, no clock: every input is forced."""

from __future__ import annotations

import pytest

from mprs_plus.autoscale import AutoPolicy, Window, default_max_workers, start_pays, usable_cores


def window(workers, waits=0.0, busy=1.0, cpu=1.0, seconds=1.0, **kwargs):
    """A window of ``seconds`` where the loop waited ``waits`` of it, each worker was busy
    ``busy`` of it and used ``cpu`` CPU seconds per busy second."""
    busy_s = busy * workers * seconds
    return Window(workers, seconds, 100, waits * seconds, busy_s, cpu * busy_s, **kwargs)


def test_waiting_samples_earn_workers_past_the_cores_up_to_the_cap():
    policy = AutoPolicy(max_workers=16, cores=2)
    assert policy.first().workers == 1
    counts = [1]
    for _ in range(4):  # samples that sleep: busy all the time, almost no CPU
        counts.append(policy.decide(window(counts[-1], waits=0.9, busy=1.0, cpu=0.05)).workers)
    assert counts == [1, 8, 16, 16, 16]
    assert policy.decisions[-1].limit == "max_workers"
    assert "held at max_workers=16" in policy.summary() and "(1 -> 8 -> 16)" in policy.summary()


def test_work_on_the_cpu_grows_to_the_cores_and_no_further():
    policy = AutoPolicy(max_workers=16, cores=3)
    first = policy.decide(window(1, waits=0.9, busy=1.0, cpu=1.0))
    assert first.workers == 3 and first.limit == "cores"
    assert policy.decide(window(3, waits=0.5, busy=1.0, cpu=1.0)).workers == 3
    assert "held at the 3 cores" in policy.decisions[-1].reason
    # The loop's own CPU counts: with it busy 1.5 cores' worth, two are left to workers.
    assert AutoPolicy(16, 4).decide(window(1, waits=0.9, cpu=1.0, main_cpu_s=0.9)).workers == 3


def test_the_loop_that_sets_the_pace_keeps_the_count():
    policy = AutoPolicy(max_workers=16, cores=2)
    decision = policy.decide(window(1, waits=0.02, busy=0.8))
    assert decision.workers == 1 and "the loop sets the pace" in decision.reason


def test_idle_workers_that_the_loop_waits_for_are_not_helped_by_more():
    decision = AutoPolicy(16, 2).decide(window(2, waits=0.6, busy=0.2))
    assert decision.workers == 2 and "more would not help" in decision.reason


def test_mostly_idle_workers_of_a_loop_that_sets_the_pace_are_retired():
    decision = AutoPolicy(16, 8).decide(window(8, waits=0.01, busy=0.2))
    assert decision.workers == 2 and "8 -> 2" in decision.reason
    # Busy enough: kept (a resize costs a start of the workers, worth it for half or less).
    assert AutoPolicy(16, 8).decide(window(8, waits=0.01, busy=0.45)).workers == 8
    assert AutoPolicy(16, 8).decide(window(4, waits=0.01, busy=0.39)).workers == 2


def test_memory_refuses_a_worker_that_would_not_fit():
    gib = 1 << 30
    policy = AutoPolicy(max_workers=16, cores=64)
    # 2 GiB each measured, 5 GiB available: 1.5x headroom, 10% kept -> one more (3 GiB each).
    decision = policy.decide(window(2, waits=0.9, cpu=0.1, worker_memory=2 * gib, available_memory=5 * gib))
    assert decision.workers == 3 and decision.limit == "memory"
    assert "held by memory" in decision.reason
    none = policy.decide(window(3, waits=0.9, cpu=0.1, worker_memory=2 * gib, available_memory=2 * gib))
    assert none.workers == 3 and none.limit == "memory"
    # Unknown memory (no worker measured yet): the cap alone.
    assert policy.decide(window(1, waits=0.9, cpu=0.1, available_memory=gib)).workers == 8


def test_the_first_count_is_small_and_within_memory():
    assert AutoPolicy(16, 8, start=2).first().workers == 2
    assert AutoPolicy(16, 8, start=4).first(worker_memory=1 << 30, available_memory=1 << 30).workers == 1
    assert AutoPolicy(1, 8, start=4).first().workers == 1


def test_a_window_too_short_decides_nothing():
    policy = AutoPolicy(16, 2)
    assert not policy.ready(Window(1, 0.05, 100, 0.04, 0.05, 0.05))
    assert not policy.ready(Window(1, 5.0, 3, 3.0, 5.0, 5.0))  # 3 batches, the loop waiting 60%
    assert not policy.ready(Window(1, 5.0, 2, 5.0, 5.0, 5.0))
    assert policy.ready(Window(1, 1.0, 10, 0.5, 1.0, 1.0))


def test_a_loop_that_does_nothing_but_wait_is_judged_after_three_batches():
    policy = AutoPolicy(16, 2)
    assert policy.ready(Window(1, 0.24, 3, 0.23, 0.24, 0.01))  # 10 ms samples in batches of 8, one worker
    assert not policy.ready(Window(1, 0.12, 3, 0.11, 0.12, 0.01))  # still under MIN_SECONDS


def test_more_workers_start_now_only_where_the_rest_of_the_epoch_wins_the_start_back():
    # 10 batches a second at one worker, the loop waiting 90%: up to 8x with 8 workers.
    waiting = window(1, waits=0.9, cpu=0.05, seconds=10.0)
    assert waiting.batches / waiting.seconds == 10
    assert start_pays(waiting, 8, batches_left=100, start_s=0.5)  # 10 s now, 0.5 + 1.25 s then
    assert not start_pays(waiting, 8, batches_left=3, start_s=0.5)  # 0.3 s now, 0.5 + 0.04 then
    # The loop waiting 20%: at most 1.25x, whatever the count.
    busy_loop = window(1, waits=0.2, cpu=0.05, seconds=10.0)
    assert not start_pays(busy_loop, 8, batches_left=20, start_s=0.5)  # 2 s now, 0.5 + 1.6 then
    assert start_pays(busy_loop, 8, batches_left=40, start_s=0.5)  # 4 s now, 0.5 + 3.2 then
    assert start_pays(waiting, 1, batches_left=1, start_s=10.0)  # not growth: not this rule's


def test_the_cap_and_the_cores():
    assert default_max_workers(2) == 8 and default_max_workers(1) == 4 and default_max_workers(16) == 64
    assert usable_cores() >= 1
    with pytest.raises(ValueError, match="max_workers must be >= 1"):
        AutoPolicy(0, 2)


def test_a_count_near_the_cap_goes_to_the_cap_at_once():
    """A change costs a start of the workers: 7 of 8 would be followed by one more change."""
    decision = AutoPolicy(max_workers=8, cores=2).decide(window(1, waits=0.86, busy=1.0, cpu=0.05))
    assert decision.workers == 8 and decision.limit == "max_workers"

