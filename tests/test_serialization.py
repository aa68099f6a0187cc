"""Segments cross into spawned and forkserver children as torchdata's do: with pickle, and
with dill, when it is installed, for what pickle cannot carry (lambdas, local functions).
Without dill, such a segment is refused with an error naming the object.

DataLoader2 itself copies the pipe it is given with pickle (and dill, when installed) before
a reading service sees it: where dill is really absent, torchdata refuses a lambda there, with
pickle's own error. The refusal of ours is then reached through the service directly, as it is
with DataLoader2 for objects that even dill cannot carry. Pickle's error for a lambda differs
by kind and Python version (up to 3.13, ``AttributeError`` "Can't pickle local object" for a
local one and ``PicklingError`` for one it cannot look up by name; ``PicklingError`` for both
on 3.14): the refusal names the object whichever it is."""

from __future__ import annotations

import pickle
import re

import pytest
from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

from mprs_plus import MultiProcessingReadingService
from mprs_plus.runtime import segments
from mprs_plus.runtime.main import diagnose


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


LAMBDA_REFUSAL = r"MapperIterDataPipe\.fn = <function .*lambda.* cannot be pickled"


def test_without_dill_a_lambda_is_refused_naming_it(monkeypatch):
    monkeypatch.setattr(segments, "_dill", lambda: None)  # as when dill is not installed
    service = MultiProcessingReadingService(2, multiprocessing_context="spawn")
    try:
        # The service directly: without dill, DataLoader2's own copy of the pipe would refuse first.
        with pytest.raises(TypeError, match=LAMBDA_REFUSAL) as info:
            service.initialize(lambda_pipe())
        assert "install dill" in str(info.value)
    finally:
        service.finalize()


def test_through_dataloader2_a_lambda_dill_would_carry_is_refused_by_the_service(monkeypatch):
    # DataLoader2 copies the pipe with dill; the service, made to see no dill, refuses it.
    pytest.importorskip("dill", reason="without dill, DataLoader2 refuses a lambda before any service sees it")
    monkeypatch.setattr(segments, "_dill", lambda: None)
    service = MultiProcessingReadingService(2, multiprocessing_context="spawn")
    loader = DataLoader2(lambda_pipe(), reading_service=service)
    try:
        with pytest.raises(TypeError, match=LAMBDA_REFUSAL) as info:
            next(iter(loader))
        assert "install dill" in str(info.value)
    finally:
        loader.shutdown()


def _local_lambda_error() -> Exception:
    return AttributeError("Can't pickle local object 'lambda_pipe.<locals>.<lambda>'")  # up to 3.13


def _module_lambda_error() -> Exception:
    return pickle.PicklingError(  # up to 3.13, for a function pickle cannot look up by name
        "Can't pickle <function <lambda> at 0x7f0000000000>: attribute lookup <lambda> on tests failed"
    )


def _local_lambda_error_314() -> Exception:
    error = pickle.PicklingError("Can't pickle local object <function lambda_pipe.<locals>.<lambda> at 0x7f0000000000>")
    error.add_note("when serializing MapperIterDataPipe state")
    return error


@pytest.mark.parametrize("error", [_module_lambda_error, _local_lambda_error, _local_lambda_error_314])
def test_the_refusal_names_the_lambda_whatever_error_pickle_raises(monkeypatch, error):
    # Every failing pickle raises the given shape, as that Python version's pickle would.
    def dumps_segment(obj):
        try:
            return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), False
        except Exception:
            raise error() from None

    monkeypatch.setattr(segments, "_dill", lambda: None)
    monkeypatch.setattr(segments, "dumps_segment", dumps_segment)
    refusal = diagnose.unpicklable_error(lambda_pipe(), "spawn", "mprs_plus worker 0")
    assert re.search(LAMBDA_REFUSAL, str(refusal))
    assert type(error()).__name__ in str(refusal) and "install dill" in str(refusal)


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
