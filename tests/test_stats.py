"""Live statistics: values that must hold, and the verdicts for clear-cut cases."""

from __future__ import annotations

import functools
import logging
import os
import threading
from dataclasses import replace

import pytest
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

import pipelines
from mprs_plus import MultiProcessingReadingService
from mprs_plus.segment import Segment
import mprs_plus.stats as stats_module
from mprs_plus.stats import ProcessStats, SegmentStats, aggregate, bottleneck


def run_epoch(pipe, consume=None, **options):
    service = MultiProcessingReadingService(2, **options)
    loader = DataLoader2(pipe, reading_service=service)
    try:
        for item in loader:
            if consume is not None:
                consume(item)
        return loader.reading_service.stats()
    finally:
        loader.shutdown()


def test_items_out_of_workers_equal_items_into_main():
    stats = run_epoch(IterableWrapper(range(1000)).sharding_filter().map(pipelines.kilobytes))
    workers, main = stats.segment("worker"), stats.segment("main")
    assert workers.processes == 2 and main.processes == 1
    assert workers.items_out == main.items_in == 1000
    assert workers.bytes_out >= 1000 * 64 * 1024  # every payload crossed a channel
    assert [p.items_out for p in stats.processes if p.role == "worker"] == [500, 500]
    for process in stats.processes:
        assert 0.0 <= process.busy_fraction <= 1.0 and process.elapsed_s > 0


def test_dispatch_items_reach_workers_and_main():
    pipe = IterableWrapper(range(300)).sharding_round_robin_dispatch(
        pipelines.SHARDING_PRIORITIES.MULTIPROCESSING
    ).map(pipelines.double)
    stats = run_epoch(pipe)
    dispatch, workers, main = (stats.segment(name) for name in ("dispatch", "worker", "main"))
    assert dispatch.items_out == workers.items_in == workers.items_out == main.items_in == 300


def test_slow_workers_are_named_the_bottleneck():
    # 1.5 s of work per worker: far more than starting them, even on a loaded machine, so
    # the verdict is never "starting the workers took most of the time"
    stats = run_epoch(IterableWrapper(range(1500)).sharding_filter().map(pipelines.spin))
    # On a loaded machine one worker may get less of a core than the other, which then
    # waits for room: the verdict names that worker, as a limit of the workers still.
    workers_limit = ("the workers are the bottleneck", "worker 0 is the bottleneck", "worker 1 is the bottleneck")
    assert stats.bottleneck.startswith(workers_limit), stats.summary()
    assert stats.segment("main").input_wait_fraction > 0.5


def _wait(item, seconds):
    """At least ``seconds`` in this stage, whatever the machine's load (an Event never set)."""
    threading.Event().wait(seconds)
    return item


def test_the_main_process_time_is_split_between_its_datapipes_and_the_loop():
    # Two lower bounds that only hold together if each second lands in its own share: 30
    # items, 20 ms each in a main-segment stage, 30 ms each in the loop.
    source = pipelines.NonReplicable(IterableWrapper(range(30)).sharding_filter())
    pipe = source.map(functools.partial(_wait, seconds=0.02))
    stats = run_epoch(pipe, consume=functools.partial(_wait, seconds=0.03))
    (main,) = [p for p in stats.processes if p.role == "main"]
    assert main.main_segment_s >= 30 * 0.02, main
    assert main.loop_s >= 30 * 0.03, main
    assert main.first_ask_s > 0 and main.first_item_s >= main.first_ask_s
    shares = stats.segment("main")
    total = (
        shares.starting_fraction + shares.input_wait_fraction + shares.receiving_fraction
        + shares.main_segment_fraction + shares.loop_fraction
    )
    assert total == pytest.approx(1.0, abs=0.02)  # the split covers the main process's life
    assert "the main process's time: starting" in stats.summary()


@pytest.mark.parametrize(
    "segments, verdict",
    [
        (
            [
                SegmentStats("dispatch", 1, 0, 100, 0.95, 0.0, 0.0, 0),
                SegmentStats("worker", 2, 100, 100, 0.2, 0.8, 0.0, 0),
                SegmentStats("main", 1, 100, 100, 0.1, 0.9, 0.0, 0),
            ],
            "the dispatch process is the bottleneck",
        ),
        (
            [SegmentStats("worker", 2, 0, 100, 0.1, 0.0, 0.85, 0), SegmentStats("main", 1, 100, 100, 0.9, 0.1, 0, 0)],
            "the pipeline keeps up: the main process waits only 10% of the time",
        ),
        (
            [SegmentStats("worker", 2, 0, 100, 0.97, 0.0, 0.0, 0), SegmentStats("main", 1, 100, 100, 0.2, 0.8, 0, 0)],
            "the workers are the bottleneck: they are 97% busy",
        ),
        (
            [SegmentStats("worker", 2, 0, 100, 0.5, 0.0, 0.2, 0), SegmentStats("main", 1, 100, 100, 0.5, 0.4, 0, 0)],
            "the workers are the bottleneck: they are 50% busy and the main process waits 40%",
        ),
    ],
    ids=["dispatch", "keeps_up", "workers", "workers_half_busy"],
)
def test_verdicts(segments, verdict):
    assert bottleneck(segments).startswith(verdict)


def test_no_statistics_before_an_epoch_or_when_disabled():
    service = MultiProcessingReadingService(2)
    assert service.stats().bottleneck.startswith("no statistics yet")
    stats = run_epoch(IterableWrapper(range(10)).sharding_filter(), collect_stats=False)
    assert stats.processes == () and stats.bottleneck.startswith("no statistics yet")


def test_periodic_summary_is_logged(caplog):
    caplog.set_level(logging.INFO, logger="mprs_plus.stats")
    run_epoch(IterableWrapper(range(300)).sharding_filter().map(pipelines.spin), stats_interval=0.1)
    summaries = [r for r in caplog.records if r.name == "mprs_plus.stats"]
    assert summaries and "worker" in summaries[-1].getMessage()


def test_stats_interval_needs_collection():
    with pytest.raises(ValueError, match="needs collect_stats=True"):
        MultiProcessingReadingService(2, collect_stats=False, stats_interval=1.0)


def test_the_service_object_the_user_created_reports_the_running_copy():
    service = MultiProcessingReadingService(2)
    assert service.stats().processes == ()
    loader = DataLoader2(IterableWrapper(range(40)).sharding_filter(), reading_service=service)
    try:
        for _ in range(2):
            assert len(list(loader)) == 40
        assert loader.reading_service is not service  # DataLoader2 runs a copy
        live = service.stats()
        assert live.segment("main").items_in == 80
        assert live.segment("worker").items_out == loader.reading_service.stats().segment("worker").items_out
    finally:
        loader.shutdown()
    final = service.stats()  # as they stood at shutdown
    assert final.segment("main").items_in == 80
    assert loader.reading_service.stats().segment("main").items_in == 80


def test_copies_in_two_loaders_report_the_last_one_started():
    service = MultiProcessingReadingService(2)
    first = DataLoader2(IterableWrapper(range(10)).sharding_filter(), reading_service=service)
    second = DataLoader2(IterableWrapper(range(30)).sharding_filter(), reading_service=service)
    try:
        list(first)
        list(second)
        assert service.stats().segment("main").items_in == 30
        assert first.reading_service.stats().segment("main").items_in == 10
    finally:
        first.shutdown()
        second.shutdown()


def test_workers_count_the_messages_that_carry_their_items():
    stats = run_epoch(IterableWrapper(range(1000)).sharding_filter())
    workers = [p for p in stats.processes if p.role == "worker"]
    assert all(p.messages_out > 0 for p in workers)  # items travel in batches: a message carries many
    assert stats.segment("worker").messages_out == sum(p.messages_out for p in workers)
    pipe = IterableWrapper(range(300)).sharding_round_robin_dispatch(
        pipelines.SHARDING_PRIORITIES.MULTIPROCESSING
    ).map(pipelines.double)
    assert run_epoch(pipe).segment("dispatch").messages_out > 0  # counted in the dispatch process's own row


# Verdicts for workers that are mostly idle while the main segment waits on their output:
# the items are slow to cross, not to make. Numbers are forced, not timed.
IDLE = SegmentStats("worker", 2, 0, 1000, 0.16, 0.0, 0.0, 0, messages_out=40)
WAITING_MAIN = SegmentStats("main", 1, 1000, 1000, 0.01, 0.99, 0.0, 0)


def test_idle_workers_and_a_waiting_loop_name_the_transport_not_the_workers():
    verdict = bottleneck([IDLE, WAITING_MAIN])
    assert verdict.startswith("the transport is the bottleneck: the workers are only 16% busy"), verdict
    assert "(25.0 items per message)" in verdict and "batch them in the worker segment" in verdict
    assert "add workers" not in verdict


def test_idle_ray_workers_and_a_waiting_loop_name_the_network():
    verdict = bottleneck([IDLE, WAITING_MAIN], network=True)
    assert verdict.startswith("the network is the bottleneck: the workers are only 16% busy"), verdict
    assert "use local workers" in verdict and "add workers" not in verdict


def test_busy_workers_are_the_bottleneck_on_a_cluster_too():
    busy = SegmentStats("worker", 2, 0, 1000, 0.97, 0.0, 0.0, 0, messages_out=40)
    verdict = bottleneck([busy, WAITING_MAIN], network=True)
    assert verdict.startswith("the workers are the bottleneck: they are 97% busy"), verdict


@pytest.mark.parametrize("network, named", [(False, "the transport"), (True, "the network")])
def test_both_ends_waiting_on_the_channel_name_it(network, named):
    handing_on = SegmentStats("worker", 2, 0, 1000, 0.2, 0.0, 0.75, 0)
    verdict = bottleneck([handing_on, WAITING_MAIN], network=network)
    assert verdict.startswith(f"{named} is the bottleneck: workers"), verdict


def test_idle_workers_waiting_for_an_idle_dispatcher_name_its_channels():
    dispatch = SegmentStats("dispatch", 1, 0, 1000, 0.3, 0.0, 0.1, 0)
    waiting = SegmentStats("worker", 2, 1000, 1000, 0.1, 0.8, 0.0, 0)
    verdict = bottleneck([dispatch, waiting, WAITING_MAIN])
    assert verdict.startswith("the transport from the dispatch process is the bottleneck"), verdict
    assert "sharding_round_robin_dispatch" in verdict and "add workers" not in verdict
    verdict = bottleneck([dispatch, waiting, WAITING_MAIN], network=True)
    assert verdict.startswith("the network between the dispatch process and the workers is the bottleneck"), verdict


@pytest.mark.parametrize("network", [False, True])
@pytest.mark.parametrize("dispatch_busy", [None, 0.1, 0.6])
def test_mostly_idle_workers_are_never_told_to_add_workers(network, dispatch_busy):
    steps = [0.0, 0.2, 0.4, 0.49]
    for busy in steps:
        for waiting_input in steps:
            for waiting_output in steps:
                for main_waits in (0.51, 0.8, 1.0):
                    workers = SegmentStats("worker", 2, 100, 100, busy, waiting_input, waiting_output, 0, 10)
                    main = SegmentStats("main", 1, 100, 100, 1.0 - main_waits, main_waits, 0.0, 0)
                    segments = [workers, main]
                    if dispatch_busy is not None:
                        segments.insert(0, SegmentStats("dispatch", 1, 0, 100, dispatch_busy, 0.0, 0.0, 0))
                    verdict = bottleneck(segments, network=network)
                    assert "add workers" not in verdict, (segments, verdict)


def test_a_run_spent_starting_the_workers_says_so():
    verdict = bottleneck([IDLE, WAITING_MAIN], network=True, startup=(1.9, 2.0))
    assert verdict.startswith("starting the workers took most of the time so far: 1.9 s of the main process's 2.0 s")
    assert "before the loop had its first item" in verdict
    # Once the workers have run most of the main process's life, the steady state speaks.
    assert bottleneck([IDLE, WAITING_MAIN], startup=(0.5, 2.0)).startswith("the transport is the bottleneck")


def _process(role, index, elapsed, busy, waiting_input, items_in, items_out, messages, node=""):
    return ProcessStats(
        role=Segment(role),
        index=index,
        pid=100 + index,
        items_in=items_in,
        items_out=items_out,
        busy_s=busy * elapsed,
        waiting_input_s=waiting_input * elapsed,
        waiting_output_s=0.0,
        bytes_out=4000,
        elapsed_s=elapsed,
        queued=0,
        node=node,
        messages_out=messages,
    )


def test_children_on_nodes_get_the_network_verdict_and_a_line_each():
    node = "10.0.0.2 (node id 8820d41f3c09)"
    processes = [
        _process("worker", 0, 10.0, 0.16, 0.0, 0, 500, 20, node),
        _process("worker", 1, 10.0, 0.16, 0.0, 0, 500, 20, node),
        _process("main", 0, 10.2, 0.01, 0.99, 1000, 1000, 0),
    ]
    stats = aggregate(processes)
    assert stats.segment("worker").messages_out == 40
    assert stats.bottleneck.startswith("the network is the bottleneck"), stats.bottleneck
    assert "  worker 0 sent 500 items in 20 messages (25.0 items per message), 0.0 MB: busy 16%" in stats.summary()
    local = aggregate([replace(p, node="") for p in processes])
    assert local.bottleneck.startswith("the transport is the bottleneck") and "worker 0 sent" not in local.summary()
    # The same figures, but the workers ran only the last 0.2 s of the main process's 10.2 s.
    late = aggregate([replace(p, elapsed_s=0.2) if p.role == "worker" else p for p in processes])
    assert late.bottleneck.startswith("starting the workers took most of the time so far: 10.0 s"), late.bottleneck


def test_print_shows_the_summary_and_repr_stays_a_repr():
    stats = aggregate([_process("worker", 0, 1.0, 0.9, 0.0, 0, 10, 2), _process("main", 0, 1.0, 0.1, 0.9, 10, 10, 0)])
    assert str(stats) == stats.summary() and f"{stats}" == stats.summary()
    assert stats.summary().splitlines()[0] == stats.bottleneck
    assert repr(stats).startswith("Stats(processes=(ProcessStats(")


# One test per verdict, each with the figures of a pipeline in that state, through
# aggregate() as a snapshot computes them (the main process's time split included). The
# states a real run reaches depend on the machine's load; these figures do not.
def _main_process(elapsed=10.0, waiting=0.0, receiving=0.0, own=0.0, starting=0.0, items=1000):
    return ProcessStats(
        role=Segment.MAIN,
        index=0,
        pid=1,
        items_in=items,
        items_out=items,
        busy_s=elapsed - waiting,
        waiting_input_s=waiting,
        waiting_output_s=0.0,
        bytes_out=0,
        elapsed_s=elapsed,
        queued=0,
        in_service_s=waiting + receiving + own,
        receiving_s=receiving,
        first_ask_s=starting,
        first_item_s=starting + 0.01,
    )


def _child(role, index=0, busy=0.0, waiting_input=0.0, waiting_output=0.0, elapsed=9.9, node=""):
    return ProcessStats(
        role=Segment(role),
        index=index,
        pid=10 + index,
        items_in=1000 if role == "worker" else 0,
        items_out=1000,
        busy_s=busy * elapsed,
        waiting_input_s=waiting_input * elapsed,
        waiting_output_s=waiting_output * elapsed,
        bytes_out=1000,
        elapsed_s=elapsed,
        queued=0,
        messages_out=40,
        node=node,
    )


def _verdict(*processes):
    stats = aggregate(list(processes))
    assert stats.summary().splitlines()[0] == stats.bottleneck
    return stats.bottleneck


def test_verdict_keeping_up_says_there_is_nothing_to_change():
    # The loop (a training step) takes 85% of the main process's time; the workers wait for it.
    verdict = _verdict(_child("worker", busy=0.1, waiting_output=0.8), _main_process(waiting=0.5, receiving=0.5, own=0.5))
    assert verdict.startswith("the pipeline keeps up: the main process waits only 5% of the time"), verdict
    assert "your loop" in verdict and "takes 85%" in verdict and "Nothing to change in the pipeline" in verdict
    assert "bottleneck" not in verdict


def test_verdict_main_segment_names_the_datapipes_in_the_main_process():
    verdict = _verdict(_child("worker", busy=0.1, waiting_output=0.8), _main_process(waiting=0.5, own=6.0))
    assert verdict.startswith("the main segment is the bottleneck: its DataPipes"), verdict
    assert "take 60% of the main process's time" in verdict and "move their work before" in verdict
    assert "add workers" not in verdict


def test_verdict_hand_over_in_the_main_process_names_the_transport_or_the_network():
    busy_receiving = _main_process(waiting=0.5, receiving=6.0, own=0.5)
    verdict = _verdict(_child("worker", busy=0.1, waiting_output=0.8), busy_receiving)
    assert verdict.startswith("the transport is the bottleneck: the main process spends 60% of its time taking items")
    remote = _verdict(_child("worker", busy=0.1, waiting_output=0.8, node="10.0.0.2"), busy_receiving)
    assert remote.startswith("the network is the bottleneck: the main process spends 60%"), remote


def test_verdict_workers(monkeypatch):
    monkeypatch.setattr(stats_module, "_host_cores", lambda: 4)
    verdict = _verdict(_child("worker", busy=0.95), _main_process(waiting=8.0))
    assert verdict.startswith("the workers are the bottleneck: they are 95% busy and the main process waits 80%")
    assert "add workers" in verdict


def test_verdict_busy_workers_on_every_core_are_not_told_to_add_workers(monkeypatch):
    # Two busy workers on a host of two cores: a third would take its core from one of them.
    monkeypatch.setattr(stats_module, "_host_cores", lambda: 2)
    busy = [_child("worker", index=i, busy=0.8, waiting_output=0.15) for i in range(2)]
    verdict = _verdict(*busy, _main_process(waiting=7.0))
    assert verdict.startswith("the workers are the bottleneck: they are 80% busy and the main process waits 70%")
    assert "add workers" not in verdict
    assert "each of this host's 2 usable cores already runs one of the 2 workers" in verdict
    assert "make the work per item cheaper" in verdict
    # One worker on those two cores: another has a core of its own.
    assert "add workers" in _verdict(busy[0], _main_process(waiting=7.0))
    # On a cluster's nodes this host's cores are not theirs: the count is not asked for.
    monkeypatch.setattr(stats_module, "_host_cores", lambda: pytest.fail("host cores read for remote workers"))
    remote = [_child("worker", index=i, busy=0.8, node="10.0.0.2") for i in range(2)]
    assert "add workers" in _verdict(*remote, _main_process(waiting=7.0))


def test_verdict_dispatch():
    verdict = _verdict(
        _child("dispatch", busy=0.9), _child("worker", busy=0.1, waiting_input=0.85), _main_process(waiting=8.0)
    )
    assert verdict.startswith("the dispatch process is the bottleneck: it is 90% busy"), verdict
    assert "move work after the dispatcher" in verdict


def test_verdict_idle_workers_and_a_waiting_loop_name_the_hand_over():
    verdict = _verdict(_child("worker", busy=0.1), _main_process(waiting=4.0, receiving=0.5))
    assert verdict.startswith("the transport is the bottleneck: the workers are only 10% busy"), verdict
    assert "main process waits 40% of the time" in verdict and "add workers" not in verdict


def test_verdict_network():
    verdict = _verdict(_child("worker", busy=0.1, node="10.0.0.2"), _main_process(waiting=4.0))
    assert verdict.startswith("the network is the bottleneck: the workers are only 10% busy"), verdict


def test_verdict_start():
    # The workers ran only the last 0.05 s of the main process's 0.2 s.
    verdict = _verdict(_child("worker", busy=0.1, elapsed=0.05), _main_process(elapsed=0.2, waiting=0.1, starting=0.05))
    assert verdict.startswith("starting the workers took most of the time so far: 0.15 s of the main process's 0.20 s")


def test_no_figures_mean_a_verdict_that_names_a_limit_or_keeps_up():
    # Whatever the figures, the verdict names one thing that limits, or says the pipeline
    # keeps up: never both (the old "balanced: ..., the main segment waits 38%").
    steps = [0.0, 0.1, 0.19, 0.2, 0.38, 0.5, 0.51, 0.8, 1.0]
    for busy in steps:
        for waits in steps:
            for waiting_output in (0.0, 0.6):
                verdict = bottleneck(
                    [
                        SegmentStats("worker", 2, 0, 100, busy, 0.0, waiting_output, 0, 10),
                        SegmentStats("main", 1, 100, 100, 1.0 - waits, waits, 0.0, 0),
                    ]
                )
                keeps_up = verdict.startswith("the pipeline keeps up")
                assert keeps_up != ("the bottleneck: " in verdict), verdict
                assert keeps_up == (waits < 0.2), verdict


def test_the_summary_says_its_counts_add_up_over_epochs():
    service = MultiProcessingReadingService(2)
    loader = DataLoader2(IterableWrapper(range(8)).sharding_filter(), reading_service=service)
    try:
        for _ in range(2):
            assert len(list(loader)) == 8
        stats = loader.reading_service.stats()
    finally:
        loader.shutdown()
    assert stats.epochs == 2 and stats.segment("main").items_in == 16
    assert "  counts since the service started, over 2 epochs (not per epoch):" in stats.summary()


def test_verdict_names_the_one_slow_worker_the_others_wait_for():
    # Worker 0 makes its items at half the pace of worker 1 (a worker whose allocator maps
    # fresh pages for every sample did): the loop takes them in turn, so worker 1 waits for
    # room while the loop waits for worker 0.
    verdict = _verdict(
        _child("worker", index=0, busy=0.9, waiting_output=0.05),
        _child("worker", index=1, busy=0.55, waiting_output=0.4),
        _main_process(waiting=8.2),
    )
    assert verdict.startswith("worker 0 is the bottleneck: it is 90% busy while worker 1 waits 40%"), verdict
    assert "in_order=False" in verdict and "add workers" not in verdict


def test_verdict_of_even_busy_workers_still_says_add_workers():
    verdict = _verdict(
        _child("worker", index=0, busy=0.75, waiting_output=0.22),
        _child("worker", index=1, busy=0.7, waiting_output=0.28),
        _main_process(waiting=9.6),
    )
    assert verdict.startswith("the workers are the bottleneck: they are 72% busy"), verdict


# Copy-on-access: the workers' private memory against what the main process held at start.
GIB = 2**30


def _worker_memory(index, growth, copied, private=None):
    """A worker whose private memory grew by ``growth`` bytes, ``copied`` of them pages it
    shared (its resident memory grew by the rest: its own allocations)."""
    return replace(
        _child("worker", index, busy=0.9),
        private_bytes=private if private is not None else growth + 50 * 2**20,
        private_growth_bytes=growth,
        resident_growth_bytes=growth - copied,
    )


def test_verdict_workers_copying_what_they_share_names_the_fixes():
    processes = [_worker_memory(0, int(0.4 * GIB), int(0.38 * GIB)), _worker_memory(1, int(0.4 * GIB), int(0.4 * GIB))]
    stats = aggregate([*processes, _main_process(waiting=6.0)], main_memory_bytes=int(1.2 * GIB))
    assert stats.memory.startswith(
        "workers are copying the dataset they share with the main process (+0.80 GiB across 2 workers; "
        "the main process held 1.20 GiB at the start)"
    ), stats.memory
    assert "numpy or Arrow columns" in stats.memory and "mprs_plus.SharedList" in stats.memory
    # It comes first; the throughput verdict follows it.
    assert stats.bottleneck.startswith(stats.memory + ". Throughput: the workers are the bottleneck")
    summary = stats.summary()
    assert summary.splitlines()[0] == stats.bottleneck
    assert "workers' private memory: 919 MiB across 2, +819 MiB since they started (+799 MiB of it pages copied" in summary


@pytest.mark.parametrize(
    "growth, copied, main, why",
    [
        (0.2, 0.2, 1.2, "under a quarter of the main process's memory"),
        (0.2, 0.2, 0.3, "under the floor of 256 MiB, however small the main process"),
        (0.8, 0.2, 1.2, "mostly the workers' own allocations, not copies"),
        (0.8, 0.8, 0.0, "the main process's memory unknown"),
    ],
)
def test_no_copying_verdict_below_the_threshold(growth, copied, main, why):
    half = int(growth * GIB / 2), int(copied * GIB / 2)
    processes = [_worker_memory(0, *half), _worker_memory(1, *half), _main_process(waiting=6.0)]
    stats = aggregate(processes, main_memory_bytes=int(main * GIB))
    assert stats.memory == "", why
    assert not stats.bottleneck.startswith("workers are copying"), why


def test_unmeasured_memory_adds_nothing_to_the_summary():
    stats = aggregate([_child("worker", busy=0.9), _main_process(waiting=6.0)], main_memory_bytes=GIB)
    assert stats.memory == "" and "private memory" not in stats.summary()


def _fetch_each_in_turn(batch):
    return len(batch)


def test_workers_copying_a_list_of_dicts_are_warned_about_at_the_users_line(monkeypatch):
    """Forced: the thresholds are lowered so that a small list of dicts, shuffled, crosses
    them; the copies are real (forked workers reading the dicts)."""
    import warnings

    import mprs_plus.stats
    from mprs_plus import DataLoader

    monkeypatch.setattr(mprs_plus.stats, "COPYING_SHARE", 0.001)
    monkeypatch.setattr(mprs_plus.stats, "COPYING_AT_LEAST", 0)
    records = [{"path": f"/data/{i:07d}.jpg", "label": i % 10, "box": [i, 4, 4, 4]} for i in range(200_000)]
    loader = DataLoader(
        records, batch_size=512, shuffle=True, num_workers=2, collate_fn=_fetch_each_in_turn,
        multiprocessing_context="fork", persistent_workers=True,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Two epochs: the second's end sees the first one's samples whatever the timing (a
        # map-style epoch can end in the main process before its workers sample their end).
        for _ in range(2):
            for _ in loader:
                pass
    copying = [w for w in caught if "workers are copying the dataset" in str(w.message).lower()]
    assert len(copying) == 1, [str(w.message) for w in caught]  # once, not once per epoch
    assert copying[0].filename == __file__ and issubclass(copying[0].category, RuntimeWarning)
    stats = loader.stats()
    assert stats.memory and stats.bottleneck.startswith("workers are copying the dataset")
    workers = [p for p in stats.processes if p.role == "worker"]
    assert all(p.copied_bytes > 0 for p in workers), workers
    assert "memory: workers are copying the dataset" in loader.explain()
    del loader


def _array_of(item):
    """An item that travels in a message of its own (an array of ``LARGE_ITEM`` bytes or more)."""
    import numpy as np

    return np.full(1 << 16, item, dtype=np.int64)


def test_the_figures_kept_at_a_stop_mid_epoch_hold_the_workers_last_counts():
    """Frozen once the workers closed their channels, after each published its last
    counts: every item a worker sent is counted, though a worker publishes its counts on
    its own only every 64 items or 0.1 s. Large items travel one to a message and a
    channel holds one, so a worker is a few items ahead of the loop's 10 reads at most."""
    pipe = IterableWrapper(range(1000)).sharding_filter().map(_array_of)
    loader = DataLoader2(pipe, reading_service=MultiProcessingReadingService(2, worker_prefetch_cnt=1))
    iterator = iter(loader)
    got = [int(next(iterator)[0]) for _ in range(10)]
    loader.shutdown()
    final = loader.reading_service.stats()
    assert got == list(range(10)) and final.segment("main").items_in == 10
    workers = [p for p in final.processes if p.role == "worker"]
    assert len(workers) == 2
    for worker in workers:
        assert 5 <= worker.items_out < 64 and worker.items_out == worker.messages_out


def test_the_figures_kept_at_a_stop_stand_as_they_were_when_the_report_is_made_later():
    """A stop keeps the figures as read then; the report is made when stats() is first
    asked for. Its times end at the stop, however much later that is."""
    import time

    from mprs_plus import DataLoader

    loader = DataLoader(list(range(64)), batch_size=4, num_workers=2)
    created = time.monotonic()
    iterator = iter(loader)
    next(iterator)
    del iterator  # stopped mid-epoch
    stopped = time.monotonic()
    while time.monotonic() - stopped < 0.3:  # time goes by before the report is asked for
        pass
    stats = loader.stats()
    assert [p.role for p in stats.processes].count(Segment.WORKER) == 2
    for process in stats.processes:  # a worker that had not begun its row yet reads 0
        assert 0 <= process.elapsed_s <= stopped - created, process
    [main] = [p for p in stats.processes if p.role is Segment.MAIN]
    assert main.elapsed_s > 0
    assert stats is loader.stats()  # made once


def test_a_stop_does_not_load_the_report_types(tmp_path):
    """Every training run's first stop would pay for them (a few ms of class creation):
    they load when statistics are first asked for."""
    import subprocess
    import sys

    script = (
        "import sys, mprs_plus\n"
        "loader = mprs_plus.DataLoader(list(range(64)), batch_size=4, num_workers=2)\n"
        "iterator = iter(loader); next(iterator); del iterator\n"
        "assert 'mprs_plus.stats' not in sys.modules, 'loaded by the stop'\n"
        "assert loader.stats().processes and 'mprs_plus.stats' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_worker_samples_its_memory_at_its_first_epochs_end_then_only_when_due(monkeypatch):
    """Forced: the clock and the sample are stand-ins. A persistent worker's later epochs
    end without a walk of its page tables until a sample is due (the first epoch's end is
    always sampled, so that a short first epoch is seen)."""
    import multiprocessing
    import types

    from mprs_plus.runtime import stats as runtime_stats

    now = [100.0]
    taken = []

    def sample():
        now[0] += 0.05  # a slow sample: the next is due 100 times as late, 5 s on
        taken.append(now[0])
        return len(taken) << 20, 1 << 30

    monkeypatch.setattr(runtime_stats, "sample", sample)
    monkeypatch.setattr(runtime_stats, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    table = runtime_stats.StatsTable(multiprocessing.get_context(), 1)
    writer = table.writer(0)

    writer.sample_memory()  # the first item: the start
    now[0] += 0.5
    writer.sample_memory(at_end=True)  # the first epoch's end: at once
    assert len(taken) == 2 and table.read(0)["private_now"] == 2 << 20
    for _ in range(9):  # nine short epochs, 0.5 s each: 4.5 s, not yet due
        now[0] += 0.5
        writer.sample_memory(at_end=True)
    assert len(taken) == 2, taken
    now[0] += 0.5
    writer.sample_memory(at_end=True)  # 5 s after the last one: due
    assert len(taken) == 3 and table.read(0)["private_now"] == 3 << 20
    assert table.read(0)["private_start"] == 1 << 20


def _start_and_first_item(table, taken):
    """What a lane's row does at its start and after its first item, in this process."""
    writer = table.writer(0)
    writer.start()
    writer.sample_start()
    row = table.read(0)
    return len(taken), row["private_start"], row["resident_start"], row["private_now"]


def _in_a_forked_child(table, taken, results):
    results.put(_start_and_first_item(table, taken))


def test_a_forked_worker_starts_its_memory_from_its_fork_without_walking_its_page_tables(monkeypatch):
    """Forced: the page-table walk is a stand-in that counts its calls. A forked child
    holds nothing of its own at its fork, so its start is private 0 and its resident size,
    and its first item walks nothing (16 ms in a worker of a 600 MB process, both workers
    at once); a process that loaded the module itself (spawn, a Ray actor) still samples
    its start after its first item."""
    import multiprocessing

    from mprs_plus.runtime import stats as runtime_stats

    taken = []

    def sample():
        taken.append(1)
        return 5 << 20, 7 << 20

    monkeypatch.setattr(runtime_stats, "sample", sample)
    fork = multiprocessing.get_context("fork")
    table = runtime_stats.StatsTable(fork, 1)
    results = fork.Queue()
    child = fork.Process(target=_in_a_forked_child, args=(table, taken, results))
    child.start()
    child.join(timeout=60)  # a few small numbers: the queue's pipe holds them
    assert child.exitcode == 0, "the child failed: its traceback is above"
    walks, private_start, resident_start, private_now = results.get(timeout=10)
    assert walks == 0 and private_start == 0 and private_now == 0
    assert resident_start > 10 << 20  # this process's resident size, read from statm

    here = runtime_stats.StatsTable(fork, 1)
    assert _start_and_first_item(here, taken) == (1, 5 << 20, 7 << 20, 5 << 20)


def _allocate_then_start_and_sample(table, results):
    """A forkserver's child is sent its dataset after its fork: memory of its own, made
    before its lane starts, then a real sample of its page tables."""
    own = bytearray(64 << 20)
    own[:: 4096] = b"x" * len(own[:: 4096])  # every page touched: resident and private
    writer = table.writer(0)
    writer.start()
    writer.sample_memory()
    row = table.read(0)
    private_growth = row["private_now"] - row["private_start"]
    resident_growth = row["resident_now"] - row["resident_start"]
    results.put((private_growth, resident_growth, len(own)))


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="reads Linux's /proc/self/smaps_rollup")
def test_memory_a_forked_child_made_before_its_lane_started_is_not_taken_for_copied_pages():
    """Its start is one moment, its fork: private 0 and its resident size then. A resident
    size read later, beside a private 0 of the fork, would count the 64 MiB it allocated
    as pages copied from its parent (private growth beyond resident growth)."""
    import multiprocessing

    from mprs_plus.runtime import stats as runtime_stats

    fork = multiprocessing.get_context("fork")
    table = runtime_stats.StatsTable(fork, 1)
    results = fork.Queue()
    child = fork.Process(target=_allocate_then_start_and_sample, args=(table, results))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0, "the child failed: its traceback is above"
    private_growth, resident_growth, allocated = results.get(timeout=10)
    assert private_growth >= allocated and resident_growth >= allocated
    assert private_growth - resident_growth < 16 << 20  # copied: a few pages, not the 64 MiB


def test_a_fork_without_statm_leaves_the_start_to_a_sample_and_never_loads_psutil(monkeypatch):
    """Forced: ``/proc/self/statm`` cannot be opened (not Linux). The hook that runs in every
    forked child then notes nothing, and loads nothing heavy; the child samples its start
    after its first item, as a spawned one does."""
    import sys

    from mprs_plus.runtime import private_memory

    def refuse(*args, **kwargs):
        raise OSError("no statm here")

    monkeypatch.setattr(private_memory, "open", refuse, raising=False)
    monkeypatch.setattr(private_memory, "_at_fork", 123)
    monkeypatch.delitem(sys.modules, "psutil", raising=False)
    private_memory._note_fork()
    assert private_memory.resident_at_fork() is None
    assert "psutil" not in sys.modules


def test_the_watchdogs_rescues_and_late_wake_ups_reach_the_process_stats_apart():
    """A process's output channels' traffic, as its row publishes it and ``stats()`` reads
    it: a late wake-up (a loaded machine) is not reported as a rescue (a bug)."""
    import multiprocessing
    import types

    from mprs_plus.runtime import stats as runtime_stats
    from mprs_plus.stats import make_process_stats
    from mprs_plus.transport.traffic import Traffic

    table = runtime_stats.StatsTable(multiprocessing.get_context(), 1)
    writer = table.writer(0)
    writer.channels = [
        types.SimpleNamespace(traffic=lambda: Traffic(5, 500, 0, 0, rescues=1, late_wakeups=2)),
        types.SimpleNamespace(traffic=lambda: Traffic(7, 700, 0, 0, late_wakeups=1)),
    ]
    writer.publish()
    process = make_process_stats("worker", 0, 1, [table.read(0)])
    assert (process.rescues, process.late_wakeups, process.messages_out) == (1, 3, 12)
