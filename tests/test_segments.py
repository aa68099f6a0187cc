"""Building the segments changes nothing a user can reach: a ``NoGraph`` reference held in
the main process to a DataPipe of another segment still reads that DataPipe's attributes;
one graph walk serves planning and segment building; self-references and cycles."""

from __future__ import annotations

import pytest
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper, IterDataPipe

import pipelines
from mprs_plus import MultiProcessingReadingService, PlanError, Segment, plan
from mprs_plus.graph import replace_reference
from mprs_plus.runtime.segments import build_main_pipeline, build_worker_program


def test_nograph_reference_to_a_worker_node_reads_its_attributes_in_main():
    loader = DataLoader2(pipelines.worker_target_pipe(6), reading_service=MultiProcessingReadingService(2))
    try:
        rows = list(loader)
    finally:
        loader.shutdown()
    assert sorted(item for item, _, _ in rows) == [0, 2, 4, 6, 8, 10]
    assert {(kind, fn) for _, kind, fn in rows} == {("MapperIterDataPipe", "double")}


def test_nograph_reference_to_a_dispatch_node_reads_its_attributes_in_main():
    loader = DataLoader2(pipelines.dispatch_target_pipe(6), reading_service=MultiProcessingReadingService(2))
    try:
        rows = list(loader)
    finally:
        loader.shutdown()
    assert sorted(item for item, _, _ in rows) == [0, 2, 4, 6, 8, 10]
    assert {kind for _, kind, _ in rows} == {"IterableWrapperIterDataPipe"}
    assert all(label == list(range(6)) for _, _, label in rows)


def test_main_segment_changes_only_the_recorded_edges():
    pipe = pipelines.worker_target_pipe(6)
    mid = pipe.dp
    state_before = dict(vars(mid))
    planned = plan(pipe, 2)
    assert planned.worker_outputs == (1,)
    build_worker_program(planned)
    reader = IterableWrapper([])  # stands for the reader of the workers' channel
    main = build_main_pipeline(planned, [reader])
    assert main is pipe and type(main) is pipelines.ReadsItsSource
    assert main.dp is reader  # the edge now reads the workers
    assert main.source.target is mid  # the NoGraph reference is untouched
    assert type(mid).__name__ == "MapperIterDataPipe" and vars(mid) == state_before


def test_replace_reference_replays_paths_through_containers():
    class Holder(IterDataPipe):
        def __init__(self, a, b):
            self.pair = (a, [b])
            self.by_name = {"a": a}

    a, b, new = IterableWrapper([1]), IterableWrapper([2]), IterableWrapper([3])
    holder = Holder(a, b)
    graph = plan(holder, 0).graph
    for edge in graph.nodes[0].edges:
        if graph.datapipes[edge.parent] is a:
            assert replace_reference(holder, edge.steps, a, new)
    assert holder.pair[0] is new and holder.by_name["a"] is new and holder.pair[1][0] is b


class RefersToItself(IterDataPipe):
    def __init__(self, dp):
        self.dp = dp
        self.me = self

    def __iter__(self):
        return iter(self.dp)


def test_a_datapipe_that_refers_to_itself_runs_as_with_torchdata():
    pipe = RefersToItself(IterableWrapper(range(6)).sharding_filter())
    planned = plan(pipe, 2)
    assert planned.graph.nodes[0].parents == (1,)
    assert planned.segments[0] is Segment.WORKER
    loader = DataLoader2(pipe, reading_service=MultiProcessingReadingService(2))
    try:
        assert sorted(loader) == list(range(6))
    finally:
        loader.shutdown()


class HoldsDownstream(IterDataPipe):
    def __init__(self, dp):
        self.dp = dp
        self.downstream = None

    def __iter__(self):
        return iter(self.dp)


def test_a_cycle_is_a_plan_error_naming_the_attribute():
    upstream = HoldsDownstream(IterableWrapper(range(4)).sharding_filter())
    top = upstream.map(abs)
    upstream.downstream = top
    with pytest.raises(PlanError, match=r"HoldsDownstream\.downstream points at MapperIterDataPipe.*cycle"):
        plan(top, 2)
