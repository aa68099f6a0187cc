"""The text and DOT renderings of a Plan, and drawing DOT as an image.

No process starts here: plans are computed and rendered in the test process. Drawing
images needs the optional graphviz package and the dot program and is skipped without
them; the DOT text is always checked.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from torchdata.datapipes.iter import IterableWrapper, IterDataPipe

import example_pipelines as pipes
import mprs_plus
from mprs_plus.errors import GraphvizNotFound

PACKAGE = Path(mprs_plus.__file__).parent
CAN_DRAW = importlib.util.find_spec("graphviz") is not None and shutil.which("dot") is not None

def test_text_of_a_three_process_pipeline_is_exact():
    text = mprs_plus.plan(pipes.three_stages(), 2).explain()
    assert text == (
        "Plan for num_workers=2: 6 DataPipes in 4 processes (1 dispatch, 2 workers, 1 main)\n"
        "\n"
        "[dispatch process: runs once, deals items round-robin to the workers]\n"
        "  #5 IterableWrapperIterDataPipe               (source)\n"
        "  #4 MapperIterDataPipe(double)                <- #5 (datapipe)\n"
        "  #3 ShardingRoundRobinDispatcherIterDataPipe  <- #4 (source_datapipe)  [dispatcher]\n"
        "    ==> queue to each of the 2 workers, items dealt round-robin\n"
        "\n"
        "[worker processes x2: each runs its own replica of these DataPipes]\n"
        "  #2 MapperIterDataPipe(double)                <- #3 (datapipe)\n"
        "    ==> queue from each worker to the main process, read round-robin\n"
        "\n"
        "[main process: reads the workers' queues round-robin]\n"
        "  #1 NonReplicable                             <- #2 (dp)\n"
        "  #0 MapperIterDataPipe(double)                <- #1 (datapipe)  [output]\n"
        "\n"
        "Sharding: #3 deals items round-robin to the 2 workers\n"
        "Warnings: none"
    )


def test_text_shows_the_replica_count_and_every_path_of_a_side_reference():
    # A side reference inside one segment is allowed; the rendering names both paths.
    class Holder(IterDataPipe):
        def __init__(self) -> None:
            self.src = IterableWrapper(range(4))
            self.dp = self.src.sharding_filter()

        def __iter__(self) -> Any:
            return iter(self.dp)

    text = mprs_plus.plan(Holder(), 3).explain()
    assert "[worker processes x3: each runs its own replica of these DataPipes]" in text
    assert "#0 Holder  <- #1 (src), #2 (dp)  [output]" in re.sub(r" {2,}", "  ", text)
    assert "[sharding point]" in text
    assert "Sharding: #2 ShardingFilterIterDataPipe splits its input across the 3 workers" in text


def test_text_says_a_sharding_filter_after_the_dispatcher_keeps_every_item():
    # Its input is already dealt out item by item; the workers do not shard it again.
    worker_filter = pipes.NonReplicable(
        pipes.IterableWrapper(range(4)).sharding_round_robin_dispatch(pipes.SHARDING_PRIORITIES.MULTIPROCESSING).sharding_filter()
    )
    text = " ".join(mprs_plus.plan(worker_filter, 2).explain().split())
    assert "#1 ShardingFilterIterDataPipe keeps every item (the dispatcher already dealt them out)" in text


def test_text_reports_the_planners_warning_and_a_main_process_without_datapipes():
    planned = mprs_plus.plan(pipes.unsharded(), 2)
    text = planned.explain()
    assert "(no DataPipe of its own: #0, the output, runs in the workers)" in text
    assert "Sharding: none" in text
    assert planned.warnings
    flattened = " ".join(text[text.index("WARNING: ") :].split())
    assert flattened == "WARNING: " + planned.warnings[0]


def test_text_without_workers_says_everything_runs_in_the_calling_process():
    text = mprs_plus.plan(pipes.three_stages(), 0).explain()
    assert text.startswith("Plan for num_workers=0: 6 DataPipes, all in the calling process\n")
    assert "[calling process]" in text
    assert "==>" not in text and "Sharding:" not in text


def test_text_when_no_datapipe_can_run_in_the_workers():
    class OneCopy(IterDataPipe):
        def __iter__(self) -> Any:
            return iter(range(3))

        def is_replicable(self) -> bool:
            return False

    planned = mprs_plus.plan(OneCopy().map(pipes.double), 2)
    text = planned.explain()
    assert text.startswith("Plan for num_workers=2: 2 DataPipes, all in the main process (no process starts)")
    assert "==>" not in text
    assert "WARNING: The worker segment is empty" in text


def _dot_strings_are_closed(dot: str) -> bool:
    """Every line has an even number of unescaped double quotes."""
    return all(len(re.findall(r'(?<!\\)(?:\\\\)*"', line)) % 2 == 0 for line in dot.splitlines())


def test_dot_draws_clusters_queues_and_markers():
    dot = mprs_plus.plan(pipes.three_stages(), 3).to_dot()
    assert dot.startswith("digraph plan {\n") and dot.endswith("\n}")
    clusters = re.findall(r"subgraph cluster_(\w+) \{", dot)
    assert clusters == ["dispatch", "worker", "main"]
    assert 'label="worker processes x3: each runs its own replica of these DataPipes"' in dot
    queues = re.findall(r"(n\d+ -> n\d+) \[label=\"queue per worker\", style=dashed", dot)
    assert queues == ["n2 -> n1", "n3 -> n2"]
    assert "  n5 -> n4;" in dot and "  n1 -> n0;" in dot
    assert re.search(r'n3 \[label="#3 ShardingRoundRobinDispatcherIterDataPipe\\ndispatcher", [^]]*penwidth=2', dot)
    assert re.search(r"n0 \[[^]]*peripheries=2\]", dot)
    assert r"Sharding: #3 deals items round-robin to the 3 workers\l" in dot
    assert _dot_strings_are_closed(dot)


def test_dot_escapes_labels_and_carries_warnings():
    tag = 'say "hi" \\ bye'
    pipe = IterableWrapper(range(3)).map(functools.partial(pipes.tagged, tag=tag))
    dot = mprs_plus.plan(pipe, 2).to_dot()
    assert _dot_strings_are_closed(dot)
    assert r"say \"hi\" \\\\ bye" in dot
    assert "WARNING: No sharding point" in dot
    assert 'n0 -> main_reader [style=dashed, label="queue per worker"];' in dot


def test_dot_names_the_paths_of_a_node_with_several_inputs():
    dot = mprs_plus.plan(pipes.two_worker_branches(), 2).to_dot()
    assert 'n1 -> n0 [label="datapipes[0]"];' in dot
    assert 'n2 -> n0 [label="datapipes[1]"];' in dot


@pytest.mark.skipif(not CAN_DRAW, reason="needs the graphviz package and Graphviz's dot program")
@pytest.mark.parametrize("fmt, magic", [("svg", b"<svg"), ("png", b"\x89PNG\r\n\x1a\n")])
def test_render_draws_an_image(fmt, magic):
    image = mprs_plus.plan(pipes.three_stages(), 2).render(fmt)
    assert magic in image[:400]


def test_render_says_what_is_missing(monkeypatch, tmp_path):
    planned = mprs_plus.plan(pipes.three_stages(), 2)
    monkeypatch.setitem(sys.modules, "graphviz", None)  # import graphviz now fails
    with pytest.raises(GraphvizNotFound, match="needs the graphviz Python package"):
        planned.render("svg")
    monkeypatch.undo()
    if importlib.util.find_spec("graphviz") is None:
        pytest.skip("the graphviz package is not installed: the missing-dot message cannot be checked")
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot program there
    with pytest.raises(GraphvizNotFound, match="needs Graphviz's dot program"):
        planned.render("png")


def test_render_rejects_other_formats():
    with pytest.raises(ValueError, match="format must be one of"):
        mprs_plus.plan(pipes.three_stages(), 2).render("pdf")


@pytest.mark.parametrize("module", ["explain.py", "plan.py"])
def test_renderings_and_planning_do_not_import_the_runtime(module):
    tree = ast.parse((PACKAGE / module).read_text(encoding="utf-8"))
    imported = [
        node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
    ] + [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    assert not [name for name in imported if "runtime" in name or "reading_service" in name]


def _double(x):
    return 2 * x


def test_explain_shows_the_stage_held_in_main_and_names_inputs_as_the_code_does():
    # FullSync pickles its state as a tuple: the walk reaches its input as __getstate__()[0],
    # which no user wrote; explain() names the attribute that holds it.
    p = mprs_plus.plan(IterableWrapper(range(8)).sharding_filter().fullsync().map(_double), 2)
    text = p.explain()
    assert "__getstate__" not in text and "__getstate__" not in p.to_dot()
    assert re.search(r"#1 FullSyncIterDataPipe\s+<- #2 \(datapipe\)", text), text
    assert "Warnings: none" not in text
    warning = " ".join(text.split("WARNING: ", 1)[1].split())
    assert warning.startswith("#0 .map(_double) runs in the main process") and "Move it before #1 .fullsync()" in warning


class _StatePositional(IterDataPipe):
    """A DataPipe whose __getstate__ is a tuple and whose input is in no attribute of its own."""

    def __init__(self, dp):
        self._inputs = {"hidden": dp}

    def __getstate__(self):
        return (self._inputs["hidden"],)

    def __iter__(self):
        return iter(self._inputs["hidden"])


def test_an_input_found_only_by_position_is_named_by_position():
    text = mprs_plus.plan(_StatePositional(IterableWrapper(range(4)).sharding_filter()), 2).explain()
    assert re.search(r"#0 _StatePositional\s+<- #1 \(input 1\)", text), text
