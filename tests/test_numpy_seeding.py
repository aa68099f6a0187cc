"""numpy's global generator in a worker: seeded as torchdata seeds it, loaded only if used.

The main process of a fresh interpreter here never loads numpy.random, so workers forked
from it start without it, and their reseeding takes the deferred path (seeding.py): the
values drawn must still be torchdata's, item for item.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).with_name("numpy_seed_script.py")
ROOT = SCRIPT.parent.parent


def _report() -> dict:
    done = subprocess.run(
        [sys.executable, "-W", "ignore", str(SCRIPT)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_workers_draw_torchdatas_values_and_load_numpy_random_only_when_the_pipeline_does():
    report = _report()
    assert report["main_loaded_numpy_random"] is False  # the deferred path was the one taken
    first, later = report["first_item"], report["second_epoch"]
    # With mprs_plus, a worker's first item finds numpy.random not loaded yet (torchdata's
    # seeding loads it), and the values drawn are torchdata's, epoch for epoch.
    assert [[loaded for _, loaded, _ in items] for items in first["mprs_plus"]][0].count(False) == 2
    assert all(loaded for _, loaded, _ in first["torchdata"][0])
    assert [[(x, v) for x, _, v in e] for e in first["mprs_plus"]] == [
        [(x, v) for x, _, v in e] for e in first["torchdata"]
    ]
    # A worker that first draws in its second epoch draws from that epoch's seed.
    assert [[(x, v) for x, _, v in e] for e in later["mprs_plus"]] == [
        [(x, v) for x, _, v in e] for e in later["torchdata"]
    ]
    assert all(v == -1 for _, _, v in later["mprs_plus"][0])
    assert len({v for _, _, v in later["mprs_plus"][1]}) == 6
    assert [v for _, _, v in first["mprs_plus"][0]] != [v for _, _, v in first["mprs_plus"][1]]  # seeds 7, 8
