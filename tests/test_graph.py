"""Graph discovery (rules 1-2): no processes."""

from __future__ import annotations

import copy
import pickle

from torch.utils.data.graph import traverse_dps
from torchdata.datapipes.iter import IterableWrapper

import pipelines
from mprs_plus import NoGraph
from mprs_plus.graph import container_items, discover, is_datapipe


def _names(graph, index):
    return [graph.nodes[p].name for p in graph.nodes[index].parents]


def test_attributes_are_parents():
    dp = IterableWrapper(range(3)).map(abs)
    graph = discover(dp)
    assert [n.name for n in graph.nodes] == ["MapperIterDataPipe", "IterableWrapperIterDataPipe"]
    assert graph.nodes[0].edges[0].path == "datapipe"


def test_get_parents_wins_over_attributes():
    graph = discover(pipelines.ParentsWrapper())
    assert graph.nodes[0].declared
    assert [e.path for e in graph.nodes[0].edges] == ["get_parents()[0]"]
    assert _names(graph, 0) == ["MapperIterDataPipe"]


def test_references_inside_containers_are_found_with_their_path():
    graph = discover(pipelines.DictSideRefWrapper())
    paths = sorted(e.path for e in graph.nodes[0].edges)
    assert paths == ["dp", "refs['src']"]
    graph = discover(pipelines.ListWrapper())
    assert [e.path for e in graph.nodes[0].edges] == ["stages[0]"]


def test_nograph_hides_from_discovery_and_from_torch():
    wrapper = pipelines.NoGraphWrapper()
    assert [e.path for e in discover(wrapper).nodes[0].edges] == ["dp"]
    children = [dp for dp, _ in traverse_dps(wrapper)[id(wrapper)][1].values()]
    assert children == [wrapper.dp]


def test_nograph_is_transparent():
    source = IterableWrapper(range(4))
    hidden = NoGraph(source)
    assert list(hidden) == [0, 1, 2, 3]
    assert len(hidden) == 4
    assert hidden.target is source
    mapped = hidden.map(str)
    assert mapped.datapipe is source  # the pipeline is built on the real DataPipe
    assert list(mapped) == ["0", "1", "2", "3"]


def test_nograph_survives_pickle_and_deepcopy():
    wrapper = pipelines.NoGraphWrapper(4)
    for clone in (pickle.loads(pickle.dumps(wrapper)), copy.deepcopy(wrapper)):
        assert isinstance(clone.src, NoGraph)
        assert list(clone.src) == [0, 1, 2, 3]
        assert [e.path for e in discover(clone).nodes[0].edges] == ["dp"]


def test_shared_nodes_are_one_node():
    source = IterableWrapper(range(4))
    zipped = source.map(abs).zip(source.map(str))
    graph = discover(zipped)
    assert sum(n.name == "IterableWrapperIterDataPipe" for n in graph.nodes) == 1
    assert len(graph.nodes) == 4


def test_datapipes_and_mappings_are_told_apart_as_isinstance_would():
    """The walk's own checks (a class's MRO, a mapping's keys) answer as isinstance does."""
    import collections
    import types

    from torch.utils.data import IterDataPipe, MapDataPipe
    from torchdata.datapipes.map import SequenceWrapper

    candidates = [IterableWrapper([1]), IterableWrapper([1]).map(abs), SequenceWrapper([1]), pipelines.NoGraphWrapper(2)]
    candidates += [1, "text", b"bytes", None, abs, lambda x: x, object(), IterDataPipe, [1], (1,)]
    for value in candidates:
        assert is_datapipe(value) == isinstance(value, (IterDataPipe, MapDataPipe)), value
    mappings = [{"a": 1}, collections.OrderedDict(a=1), types.MappingProxyType({"a": 1}), collections.ChainMap({"a": 1})]
    for mapping in mappings:
        assert container_items(mapping) == [(("item", "a"), 1)], type(mapping)
    assert container_items(1) == container_items("ab") == []

