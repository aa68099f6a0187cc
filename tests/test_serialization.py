"""Segments cross into spawned and forkserver children as torchdata's do: with pickle, and
with dill, when it is installed, for what pickle cannot carry (lambdas, local functions).
Without dill, such a segment is refused with an error naming the object."""

from __future__ import annotations

import pickle

import pytest
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from mprs_plus import MultiProcessingReadingService
from mprs_plus.runtime import segments


def lambda_pipe():
    offset = 100  # captured by a closure: pickle cannot carry either function
    pipe = IterableWrapper(range(6)).map(lambda x: x + offset)
    pipe = pipe.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    return pipe.map(lambda x: x * 2)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_lambdas_run_under_spawn_and_forkserver_with_dill(context):
    pytest.importorskip("dill")
    service = MultiProcessingReadingService(2, multiprocessing_context=context)
    loader = DataLoader2(lambda_pipe(), reading_service=service)
    try:
        assert sorted(loader) == [200, 202, 204, 206, 208, 210]
    finally:
        loader.shutdown()


def test_without_dill_a_lambda_is_refused_naming_it(monkeypatch):
    monkeypatch.setattr(segments, "_dill", lambda: None)  # as when dill is not installed
    service = MultiProcessingReadingService(2, multiprocessing_context="spawn")
    loader = DataLoader2(lambda_pipe(), reading_service=service)
    try:
        with pytest.raises(TypeError, match=r"MapperIterDataPipe\.fn = <function .*lambda.* cannot be pickled") as info:
            next(iter(loader))
        assert "install dill" in str(info.value)
    finally:
        loader.shutdown()


def test_shared_datapipes_stay_shared_across_the_boundary():
    # One blob per segment: two outputs reading one source still read one object.
    source = IterableWrapper(range(3))
    program = segments.PortableWorkerProgram((source, source), (), (source,))
    arrived = pickle.loads(pickle.dumps(program))
    assert type(arrived) is segments.WorkerProgram
    assert arrived.outputs[0] is arrived.outputs[1] is arrived.sharding_roots[0]
    sources = pickle.loads(pickle.dumps(segments.PortableSources([source, source])))
    assert type(sources) is tuple and sources[0] is sources[1]


def test_a_plain_segment_does_not_need_dill(monkeypatch):
    monkeypatch.setattr(segments, "_dill", lambda: None)
    data, used_dill = segments.dumps_segment(IterableWrapper(range(3)).map(abs))
    assert not used_dill and list(pickle.loads(data)) == [0, 1, 2]
