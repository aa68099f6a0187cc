"""``python -m mprs_plus``: the explain command end to end, help on every command, the demo.

The explain and demo checks run the command line as a user would, in a subprocess with
a timeout; argument and help checks call ``main()`` in this process, which starts nothing.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mprs_plus.__main__ import main
from mprs_plus.segment import Segment
from mprs_plus._cli import bench, demo, explain  # noqa: F401  (loaded before isolated_imports looks)

TESTS = Path(__file__).parent
ROOT = TESTS.parent
PIPES = str(TESTS / "example_pipelines.py")
CAN_DRAW = importlib.util.find_spec("graphviz") is not None and shutil.which("dot") is not None


def run_cli(*args: str, cwd: Path = ROOT, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-m", "mprs_plus", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def isolated_imports(monkeypatch):
    """In-process runs import the target; give them back sys.path and sys.modules untouched."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_explain_prints_the_plan_as_text():
    result = run_cli("explain", f"{PIPES}:wrapper_fixed", "--num-workers", "3")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("Plan for num_workers=3: 7 DataPipes in 5 processes (1 dispatch, 3 workers, 1 main)\n")
    sections = re.findall(r"^\[(\w+ process(?:es)?)[^\]]*\]$", out, flags=re.M)
    assert sections == ["dispatch process", "worker processes", "main process"]
    assert "[worker processes x3: each runs its own replica of these DataPipes]" in out
    assert out.count("==> queue") == 2
    assert "#0 Wrapper" in out and "Warnings: none" in out


def test_explain_finds_a_module_on_the_working_directory_and_writes_dot():
    result = run_cli("explain", "example_pipelines:three_stages", "--format", "dot", cwd=TESTS)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("digraph plan {\n") and result.stdout.endswith("}\n")
    assert "subgraph cluster_worker" in result.stdout and "style=dashed" in result.stdout


def test_explain_reports_an_ambiguous_graph_as_one_paragraph_with_exit_code_2():
    result = run_cli("explain", f"{PIPES}:wrapper_ambiguous")
    assert result.returncode == 2
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    paragraph = result.stderr[result.stderr.index("mprs_plus explain: AmbiguousGraphError: ") :]
    assert "\n\n" not in paragraph.strip()
    flat = " ".join(paragraph.split())
    assert "Wrapper.src (dispatch) and Wrapper.dp (main) straddle segments" in flat
    assert "NoGraph(...)" in flat and "get_parents()" in flat


def test_explain_output_file_takes_its_format_from_the_extension(tmp_path, isolated_imports, capsys):
    target = tmp_path / "plan.dot"
    assert main(["explain", f"{PIPES}:unsharded", "--output", str(target)]) == 0
    assert target.read_text(encoding="utf-8").startswith("digraph plan {")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("warning: No sharding point")  # not hidden in the file


def test_explain_shows_two_worker_branches(isolated_imports, capsys):
    assert main(["explain", f"{PIPES}:two_worker_branches"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("Plan for num_workers=2")
    assert "worker output 1 of 2" in captured.out and "worker output 2 of 2" in captured.out


@pytest.mark.parametrize(
    "target, message",
    [
        ("no_colon", "expected MODULE:FACTORY"),
        (f"{PIPES}:missing", "has no attribute 'missing'"),
        (f"{PIPES}:not_a_datapipe", "not_a_datapipe() returned int: expected an IterDataPipe or MapDataPipe"),
        (f"{PIPES}:broken", "calling broken() failed (traceback above)"),
        ("no_such_module_here:f", "no module named 'no_such_module_here'"),
        ("no/such/file.py:f", "no such file"),
    ],
)
def test_explain_says_what_is_wrong_with_the_target(target, message, isolated_imports, capsys):
    assert main(["explain", target]) == 1
    assert message in " ".join(capsys.readouterr().err.split())


def test_explain_accepts_a_datapipe_object(isolated_imports, capsys):
    assert main(["explain", f"{PIPES}:ready_made", "--num-workers", "1"]) == 0
    assert "[sharding point, output]" in capsys.readouterr().out


@pytest.mark.skipif(not CAN_DRAW, reason="needs the graphviz package and Graphviz's dot program")
def test_explain_draws_svg_and_png(tmp_path, isolated_imports):
    for name, magic in (("plan.svg", b"<svg"), ("plan.png", b"\x89PNG")):
        assert main(["explain", f"{PIPES}:three_stages", "-o", str(tmp_path / name)]) == 0
        assert magic in (tmp_path / name).read_bytes()[:400]


def test_explain_without_graphviz_says_how_to_get_it(tmp_path, monkeypatch, isolated_imports, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot program there
    assert main(["explain", f"{PIPES}:three_stages", "--output", str(tmp_path / "plan.png")]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "Traceback" not in err
    assert "needs Graphviz's dot program" in err or "needs the graphviz Python package" in err


# "bench --help" is forwarded to benchmarks/run.py and tested in test_bench.py.
@pytest.mark.parametrize("command", [[], ["demo"], ["explain"]])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m mprs_plus")
    if not command:
        assert all(name in out for name in ("demo", "explain", "bench"))


def test_explain_rejects_a_negative_worker_count(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["explain", f"{PIPES}:three_stages", "--num-workers", "-1"])
    assert exit_info.value.code == 2
    assert "must be >= 0" in capsys.readouterr().err


def test_demo_runs_each_stage_in_its_own_role():
    result = run_cli("demo", timeout=90)
    assert result.returncode == 0, result.stderr
    main_pid = int(re.search(r"^main process: pid (\d+)$", result.stdout, flags=re.M).group(1))
    rows = re.findall(r"^\s*\d+\s+(\d+)\s+(\d+)\s+(\d+)$", result.stdout, flags=re.M)
    assert len(rows) == 6
    pre, worker, post = ({int(row[i]) for row in rows} for i in range(3))
    assert post == {main_pid}
    assert len(pre) == 1 and len(worker) == 2
    assert not (pre & worker) and main_pid not in pre | worker
    # The words a newcomer reads: what the DataPipes are, and whether each stage ran as planned.
    assert "NonReplicable    a DataPipe of the demo whose is_replicable() returns False" in result.stdout
    assert "Wrapper          the outer DataPipe" in result.stdout
    closing = result.stdout.strip().splitlines()[-3:]
    assert closing == [
        f"Pre Main ran in the dispatch process (process {min(pre)}), as planned.",
        f"Worker ran in the 2 worker processes (processes {', '.join(map(str, sorted(worker)))}), as planned.",
        f"Post Main ran in the main process (process {main_pid}), as planned.",
    ]


def test_the_demo_says_when_a_stage_did_not_run_where_planned():
    # Forced: every stage stamped by the main process, as torchdata's own service runs the seed.
    rows = [(i, {"Pre Main": 7, "Worker": 7, "Post Main": 7}) for i in range(6)]
    planned = {"Pre Main": Segment.DISPATCH, "Worker": Segment.WORKER, "Post Main": Segment.MAIN}
    lines = demo.where_each_stage_ran(rows, main_pid=7, planned=planned, workers=2)
    assert lines == [
        ("Pre Main ran in process 7: NOT where planned, which is the dispatch process.", False),
        ("Worker ran in process 7: NOT where planned, which is the 2 worker processes.", False),
        ("Post Main ran in the main process (process 7), as planned.", True),
    ]
    # With num_workers=0 the plan puts every stage in the main process: that is as planned.
    everything_in_main = dict.fromkeys(planned, Segment.MAIN)
    assert all(ok for _, ok in demo.where_each_stage_ran(rows, 7, everything_in_main, workers=0))


def test_help_speaks_of_what_the_user_sees(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "seed" not in out
    assert "demo run a small three-stage pipeline and show which process ran each stage" in out


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_commands_print_no_torchdata_deprecation_banner(context):
    result = run_cli("demo", "--context", context, timeout=90)
    assert result.returncode == 0, result.stderr
    assert "deprecated" not in result.stderr and "WARNING!" not in result.stderr, result.stderr


def test_the_library_still_shows_the_banner_and_main_leaves_no_filter_behind():
    # Only the command line is quieted: importing the library is as it was.
    code = "import mprs_plus; mprs_plus.MultiProcessingReadingService"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONWARNINGS", None)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "modules are deprecated" in result.stderr
    before = os.environ.get("PYTHONWARNINGS")
    with pytest.raises(SystemExit):
        main(["--help"])
    assert os.environ.get("PYTHONWARNINGS") == before
