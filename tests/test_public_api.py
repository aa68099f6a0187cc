"""The public surface is small and deliberate: pinned here."""

import mprs_plus


def test_public_names_are_pinned_and_sorted():
    assert mprs_plus.__all__ == sorted(mprs_plus.__all__)
    assert set(mprs_plus.__all__) == {
        "AmbiguousGraphError",
        "MultiProcessingReadingService",
        "NoGraph",
        "Plan",
        "PlanError",
        "ProcessDiedError",
        "Segment",
        "ServiceClosedError",
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
