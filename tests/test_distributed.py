"""SequentialReadingService(DistributedReadingService(), ours): two ranks of a gloo group on
127.0.0.1, started by the test as two processes. Ranks get disjoint shards whose union is
the dataset, seeds are shared as torchdata shares them (we read exactly what torchdata's
service reads), and fullsync keeps uneven ranks in step."""

from __future__ import annotations

import json
import pathlib

import pytest
from ranks import run_ranks

SCRIPT = pathlib.Path(__file__).with_name("distributed_script.py")
WORLD_SIZE = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each rank read: {case: {"torchdata" | "ours": [epoch, epoch]}}, per rank."""
    folder = tmp_path_factory.mktemp("ranks")
    outputs = [folder / f"rank{rank}.json" for rank in range(WORLD_SIZE)]
    run_ranks(SCRIPT, WORLD_SIZE, lambda rank, port: [str(rank), str(WORLD_SIZE), str(port), str(outputs[rank])])
    return [json.loads(path.read_text()) for path in outputs]


@pytest.mark.parametrize("case", ["sharded", "dispatch"])
def test_ranks_get_disjoint_shards_whose_union_is_the_dataset(ranks, case):
    for epoch in range(2):
        per_rank = [rank[case]["ours"][epoch] for rank in ranks]
        assert all(len(items) == 20 for items in per_rank)
        assert sorted(per_rank[0] + per_rank[1]) == [2 * i for i in range(40)]


@pytest.mark.parametrize("case", ["sharded", "dispatch", "uneven"])
def test_seeds_are_shared_as_torchdata_shares_them(ranks, case):
    for rank in ranks:
        assert rank[case]["ours"] == rank[case]["torchdata"]
        assert rank[case]["ours"][0] != rank[case]["ours"][1]  # a new shared seed every epoch


def test_fullsync_keeps_uneven_ranks_in_step(ranks):
    # 21 items over 2 ranks x 2 workers: rank 0 holds 11, rank 1 holds 10; fullsync stops
    # both at 10, and nobody hangs at the end of the epoch.
    for epoch in range(2):
        per_rank = [rank["uneven"]["ours"][epoch] for rank in ranks]
        assert [len(items) for items in per_rank] == [10, 10]
        assert not set(per_rank[0]) & set(per_rank[1])
