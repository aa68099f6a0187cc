"""The seed's own script, run as a user would: each stage in the process it asked for."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).with_name("seed_script.py")


def _stages(block: str) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for stage, pid in re.findall(r"^(Pre Main|Worker|Post Main)\s+\d+\s+(\d+)$", block, re.MULTILINE):
        found.setdefault(stage, []).append(int(pid))
    return found


@pytest.mark.parametrize("nograph", [True, False], ids=["with_nograph", "as_written"])
def test_seed_script(nograph, tmp_path):
    script = SCRIPT.read_text()
    if not nograph:
        script = script.replace("NoGraph(IterableWrapper(range(4)))", "IterableWrapper(range(4))")
    path = tmp_path / "seed.py"
    path.write_text(script)
    # Unbuffered output would write each piece of a print() on its own, and lines of
    # different processes would interleave; buffered, each print is one write.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    done = subprocess.run(
        [sys.executable, "-W", "ignore", str(path)], capture_output=True, text=True, timeout=90, env=env
    )
    main_pid = int(re.search(r"Main Process:\s+(\d+)", done.stdout).group(1))
    blocks = done.stdout.split("-------------------------------------")
    if not nograph:
        assert done.returncode != 0
        assert "AmbiguousGraphError: Wrapper.src (dispatch) and Wrapper.dp (main) straddle segments" in done.stderr
        assert len(blocks) == 2 and not _stages(blocks[1])  # refused before running anything
        return
    assert done.returncode == 0, done.stderr
    assert len(blocks) == 2
    for block in blocks:
        stages = _stages(block)
        assert all(len(stages[s]) == 4 for s in ("Pre Main", "Worker", "Post Main")), block
        (dispatch,) = set(stages["Pre Main"])
        workers = set(stages["Worker"])
        assert len(workers) == 2
        assert set(stages["Post Main"]) == {main_pid}
        assert len({dispatch, main_pid} | workers) == 4
