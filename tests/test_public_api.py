"""The public surface is small and deliberate: pinned here."""

import mprs_plus


def test_public_names_are_pinned_and_sorted():
    assert mprs_plus.__all__ == sorted(mprs_plus.__all__)
    assert set(mprs_plus.__all__) == {
        "AmbiguousGraphError",
        "DataLoader",
        "MultiProcessingReadingService",
        "NoGraph",
        "PipelineStuckError",
        "Plan",
        "PlanError",
        "ProcessDiedError",
        "RayBackend",
        "Segment",
        "ServiceClosedError",
        "SharedList",
        "WorkerError",
        "plan",
    }
    for name in mprs_plus.__all__:
        assert getattr(mprs_plus, name) is not None


def test_layers_point_one_way():
    import ast
    import pathlib

    package = pathlib.Path(mprs_plus.__file__).parent

    def imports(path):
        tree = ast.parse(path.read_text())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                found.add(("." * node.level) + (node.module or ""))
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        return found

    for name in ("graph.py", "plan.py", "explain.py"):
        assert not any("runtime" in i or "reading_service" in i for i in imports(package / name)), name
    for path in (package / "transport").glob("*.py"):
        assert not any(i.split(".")[0] in {"torch", "torchdata"} for i in imports(path)), path.name


def test_public_names_load_on_first_use_and_plan_stays_the_function():
    import subprocess
    import sys

    code = (
        "import sys, mprs_plus\n"
        "assert 'torchdata' not in sys.modules  # so the command line can quiet its banner first\n"
        "import mprs_plus.reading_service, mprs_plus.plan\n"
        "assert 'ray' not in sys.modules  # the Ray backend loads Ray only when a service uses it\n"
        "assert callable(mprs_plus.plan) and not isinstance(mprs_plus.plan, type(sys))\n"
        "from mprs_plus import MultiProcessingReadingService, plan\n"
        "assert plan.__module__ == 'mprs_plus.plan'\n"
    )
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
