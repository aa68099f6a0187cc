"""``explain TARGET``: show where each DataPipe of a user's pipeline would run, without running it.

    TARGET (MODULE:FACTORY or path/to/file.py:FACTORY) --import, call--> DataPipe
        --plan(datapipe, N)--> text | DOT | SVG | PNG

Importing the module runs its top-level code and the factory builds the pipeline, but
nothing is iterated and no process starts. A graph that cannot be split is reported as
one paragraph (exit code 2) rather than a traceback, since it is the user's to fix.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import textwrap
import traceback
from pathlib import Path
from typing import Any

from ..errors import GraphvizNotFound, PlanError
from ..graph import is_datapipe
from ..plan import Plan, plan

FORMATS = ("text", "dot", "svg", "png")
_BY_SUFFIX = {".txt": "text", ".dot": "dot", ".gv": "dot", ".svg": "svg", ".png": "png"}
_PROG = "mprs_plus explain"

# Exit codes. argparse exits with 2 on a usage error too: both mean "fix the input".
CANNOT_PLAN = 2
USAGE = 2
FAILED = 1

_EPILOG = """\
examples:
  python -m mprs_plus explain my_project.data:make_pipe --num-workers 4
  python -m mprs_plus explain path/to/pipes.py:make_pipe --format dot
  python -m mprs_plus explain my_project.data:make_pipe --output plan.svg

exit codes: 0 planned; 1 the module, the factory, Graphviz or writing FILE failed;
2 the graph cannot be planned as written (e.g. AmbiguousGraphError), or a usage error.
"""


class TargetError(Exception):
    """TARGET does not name a DataPipe factory; the message says what to change."""


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "explain",
        help="show where each DataPipe of a pipeline would run, without running it",
        description=(
            "Import MODULE, call FACTORY() to build the DataPipe, and print its plan for\n"
            "--num-workers: every DataPipe with its process, the queues between processes,\n"
            "the sharding points and the planner's warnings. Nothing is iterated."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "target",
        metavar="MODULE:FACTORY",
        help="an importable module (or a path/to/file.py) and a function in it that returns the "
        "DataPipe; a DataPipe object is accepted too",
    )
    parser.add_argument(
        "--num-workers", type=_non_negative, default=2, metavar="N", help="worker processes to plan for (default 2)"
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="text (default), dot (Graphviz source), svg or png (need the graphviz package and "
        "Graphviz's dot program); taken from --output's extension when not given",
    )
    parser.add_argument("--output", "-o", metavar="FILE", help="write to FILE instead of standard output")
    parser.set_defaults(run=run)


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    fmt = args.format or (_BY_SUFFIX.get(Path(args.output).suffix.lower(), "text") if args.output else "text")
    if fmt == "png" and args.output is None and sys.stdout.isatty():
        return _fail("PNG is binary: give --output FILE.png (or redirect standard output)", USAGE)
    try:
        datapipe = load_datapipe(args.target)
    except TargetError as exc:
        return _fail(str(exc), FAILED)
    try:
        planned = plan(datapipe, args.num_workers)
    except PlanError as exc:
        return _fail(f"{type(exc).__name__}: {exc}", CANNOT_PLAN)
    try:
        _write(planned, fmt, args.output)
    except (GraphvizNotFound, OSError) as exc:
        return _fail(str(exc), FAILED)
    if fmt != "text" or args.output is not None:
        # The warnings are inside the rendering; say them where the user is looking too.
        for warning in planned.warnings:
            print(textwrap.fill(f"warning: {warning}", 100), file=sys.stderr)
    return 0


def _write(planned: Plan, fmt: str, output: str | None) -> None:
    data: str | bytes
    if fmt == "text":
        data = planned.explain() + "\n"
    elif fmt == "dot":
        data = planned.to_dot() + "\n"
    else:
        data = planned.render(fmt)
    if output is not None and isinstance(data, str):
        Path(output).write_text(data, encoding="utf-8")
    elif output is not None:
        Path(output).write_bytes(data)
    elif isinstance(data, str):
        sys.stdout.write(data)
    else:
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()


def _fail(message: str, code: int) -> int:
    print(textwrap.fill(f"{_PROG}: {message}", 100, break_long_words=False), file=sys.stderr)
    return code


def load_datapipe(target: str) -> Any:
    """Import TARGET's module, find FACTORY (dotted names allowed), call it, check the result."""
    location, colon, name = target.rpartition(":")
    if not colon or not location or not name:
        raise TargetError(f"expected MODULE:FACTORY or path/to/file.py:FACTORY, got {target!r}")
    module = _import(location)
    found: Any = module
    for part in name.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise TargetError(f"{location} has no attribute {name!r}") from None
    if is_datapipe(found):
        return found
    if not callable(found):
        raise TargetError(f"{target} is a {type(found).__name__}: expected a function returning a DataPipe")
    try:
        datapipe = found()
    except Exception as exc:
        _print_user_traceback(exc)
        raise TargetError(f"calling {name}() failed (traceback above)") from None
    if not is_datapipe(datapipe):
        raise TargetError(f"{name}() returned {type(datapipe).__name__}: expected an IterDataPipe or MapDataPipe")
    return datapipe


def _import(location: str) -> Any:
    if location.endswith(".py") or os.sep in location or "/" in location:
        return _import_file(Path(location))
    # ``python -m`` puts the working directory on sys.path; the console script does not.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(location)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (location == exc.name or location.startswith(exc.name + ".")):
            raise TargetError(
                f"no module named {location!r}: run from the folder that contains it, add that folder to "
                "PYTHONPATH, or give a file path (path/to/file.py:FACTORY)"
            ) from None
        return _import_failed(location, exc)
    except Exception as exc:
        return _import_failed(location, exc)


def _import_file(path: Path) -> Any:
    if not path.is_file():
        raise TargetError(f"{path}: no such file")
    # Imported the way ``python path/to/file.py`` would see it: its folder first on sys.path,
    # so that it can import its neighbours. The name is private so that it shadows nothing.
    sys.path.insert(0, str(path.resolve().parent))
    name = "_mprs_plus_explain_target"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise TargetError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        return _import_failed(str(path), exc)
    return module


def _import_failed(location: str, exc: BaseException) -> Any:
    _print_user_traceback(exc)
    raise TargetError(f"importing {location} failed (traceback above)")


def _print_user_traceback(exc: BaseException) -> None:
    """The traceback from the user's first frame on: ours and importlib's say nothing to them."""
    tb = exc.__traceback__
    while tb is not None and (
        tb.tb_frame.f_code.co_filename == __file__ or tb.tb_frame.f_code.co_filename.startswith("<frozen ")
    ):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)
