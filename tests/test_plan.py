"""Planning (rules 3-5) and its renderings: pure, no processes."""

from __future__ import annotations

import functools

import pytest
from torchdata.datapipes.iter import IterableWrapper

import pipelines
from mprs_plus import AmbiguousGraphError, NoGraph, Segment, plan


def _segments_by_stage(p):
    found = {}
    for index, dp in enumerate(p.graph.datapipes):
        fn = getattr(dp, "fn", None)
        if isinstance(fn, functools.partial) and "stage" in fn.keywords:
            found[fn.keywords["stage"]] = p.segments[index]
    return found


EXPECTED = {"pre": Segment.DISPATCH, "worker": Segment.WORKER, "post": Segment.MAIN}


@pytest.mark.parametrize(
    "factory",
    [
        lambda: pipelines.seed_pipe(IterableWrapper(range(4))),
        pipelines.NoGraphWrapper,
        pipelines.ParentsWrapper,
        pipelines.ListWrapper,
        lambda: pipelines.Outer(pipelines.NoGraphWrapper()),
        lambda: pipelines.Outer(pipelines.Outer(pipelines.ParentsWrapper())),
        pipelines.MidGraphRef,
    ],
    ids=["seed", "nograph", "get_parents", "list_and_dict", "wrapper_of_wrapper", "deeper", "mid_graph_ref"],
)
def test_split_follows_the_markers(factory):
    p = plan(factory(), num_workers=2)
    assert _segments_by_stage(p) == EXPECTED
    assert p.segments[0] is Segment.MAIN
    assert not p.warnings


def test_seed_wrapper_is_an_error_naming_class_path_and_both_fixes():
    with pytest.raises(AmbiguousGraphError) as info:
        plan(pipelines.Wrapper(), num_workers=2)
    message = str(info.value)
    assert message.startswith("Wrapper.src (dispatch) and Wrapper.dp (main) straddle segments")
    assert "NoGraph(...)" in message and "Wrapper.get_parents()" in message


def test_side_reference_inside_a_dict_names_its_path():
    with pytest.raises(AmbiguousGraphError, match=r"DictSideRefWrapper\.refs\['src'\] \(dispatch\)"):
        plan(pipelines.DictSideRefWrapper(), num_workers=2)


def test_side_reference_to_a_mid_graph_node_is_an_error_without_nograph():
    with pytest.raises(AmbiguousGraphError, match=r"MidGraphRef\.mid \(worker\) and MidGraphRef\.dp \(main\)"):
        plan(pipelines.MidGraphRef(hide=False), num_workers=2)


def test_side_reference_inside_one_segment_is_allowed():
    source = IterableWrapper(range(4)).sharding_filter()
    wrapper = pipelines.Outer(source.map(abs))
    wrapper.extra = source  # side reference, but both targets run in the workers
    p = plan(wrapper, num_workers=2)
    assert set(p.segments) == {Segment.WORKER}


def test_join_of_worker_branch_and_main_source_is_allowed():
    worker_branch = IterableWrapper(range(4)).sharding_filter().map(abs)
    main_source = pipelines.NonReplicable(IterableWrapper(range(4)))
    p = plan(pipelines.NonReplicable(worker_branch).zip(main_source), num_workers=2)
    assert p.segment_of(worker_branch) is Segment.WORKER
    assert p.segment_of(main_source) is Segment.MAIN


def test_reading_the_dispatch_segment_around_the_dispatcher_is_an_error():
    source = IterableWrapper(range(4))
    dispatched = pipelines.seed_pipe(source)
    with pytest.raises(AmbiguousGraphError, match="runs in the dispatch process"):
        plan(dispatched.zip(source.map(abs)), num_workers=2)


def test_sharding_filter_without_dispatcher_runs_in_workers():
    p = plan(pipelines.sharded_pipe(), num_workers=2)
    assert _segments_by_stage(p) == {"worker": Segment.WORKER, "post": Segment.MAIN}
    assert p.sharding_points and not p.warnings


def test_no_sharding_point_warns():
    p = plan(IterableWrapper(range(4)).map(abs), num_workers=2)
    assert any("No sharding point" in w and "2 times" in w for w in p.warnings)
    assert not plan(IterableWrapper(range(4)).map(abs), num_workers=1).warnings


def test_empty_worker_segment_warns():
    p = plan(pipelines.NonReplicableSource(range(4)).map(abs), num_workers=2)
    assert any("worker segment is empty" in w and "NonReplicableSource" in w for w in p.warnings)
    assert not p.uses_processes


def test_dispatcher_straight_into_main_warns_and_keeps_the_dispatch_process():
    source = IterableWrapper(range(4)).sharding_round_robin_dispatch(pipelines.SHARDING_PRIORITIES.MULTIPROCESSING)
    p = plan(pipelines.NonReplicable(source), num_workers=2)
    assert any("worker segment is empty" in w for w in p.warnings)
    assert p.uses_processes and p.worker_outputs == p.dispatchers


def test_zero_workers_plans_everything_in_main():
    p = plan(pipelines.Wrapper(), num_workers=0)
    assert set(p.segments) == {Segment.MAIN} and not p.uses_processes


def test_bad_num_workers():
    with pytest.raises(ValueError, match="num_workers"):
        plan(IterableWrapper(range(3)), num_workers=-1)


def test_explain_shows_segments_processes_and_queues():
    text = plan(pipelines.NoGraphWrapper(), num_workers=2).explain()
    assert "4 processes (1 dispatch, 2 workers, 1 main)" in text
    assert "[dispatch process" in text and "[worker processes x2" in text and "[main process" in text
    assert text.count("==> queue") == 2


def test_plan_of_nograph_wrapped_output():
    p = plan(NoGraph(pipelines.NoGraphWrapper()), num_workers=2)
    assert p.graph.nodes[0].name == "NoGraphWrapper"


# A function of the user's per item, placed after torchdata's fullsync(): it lands in the
# main process. The planner names the stage, why it runs there, and the fix.
def test_a_stage_after_fullsync_is_named_with_why_and_the_fix():
    p = plan(IterableWrapper(range(8)).sharding_filter().fullsync().map(pipelines.double), num_workers=2)
    assert p.segments[0] is Segment.MAIN and p.held_in_main() == ((0, 1),)
    (warning,) = p.warnings
    assert warning.startswith("#0 .map(double) runs in the main process"), warning
    assert "it comes after #1 .fullsync(), which is not replicable" in warning
    assert "Move it before #1 .fullsync() so that the workers run it" in warning


def test_stages_after_one_blocker_share_a_warning_and_harmless_stages_get_none():
    source = IterableWrapper(range(8)).sharding_filter()
    p = plan(source.fullsync().map(pipelines.double).filter(bool), num_workers=2)
    (warning,) = p.warnings
    assert warning.startswith("#1 .map(double), #0 .filter(bool) run in the main process"), warning
    # Collating belongs in the main process; the work before fullsync() runs in the workers.
    assert plan(source.batch(2).fullsync().collate(), num_workers=2).warnings == ()
    assert plan(source.map(pipelines.double).fullsync(), num_workers=2).warnings == ()
    # Without workers everything runs in one process on purpose: nothing to move.
    assert plan(source.fullsync().map(pipelines.double), num_workers=0).warnings == ()


def test_after_a_non_replicable_datapipe_of_the_users_own_the_main_process_is_their_choice():
    p = plan(pipelines.seed_pipe(IterableWrapper(range(4))), num_workers=2)
    assert p.segments[0] is Segment.MAIN and p.held_in_main() == () and p.warnings == ()
