"""``bench [ARGS]``: run the benchmark suite of a source checkout (benchmarks/run.py).

The suite is not part of the installed package: it lives beside it in the repository, so
this command finds it relative to the package's parent folder (a source checkout or an
editable install) and runs it in a fresh interpreter with the remaining arguments.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent.parent


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "bench",
        help="run the benchmark suite (source checkout only); 'bench --help' lists its options",
        description=__doc__,
        # Every argument after "bench" belongs to the suite, --help included: this parser has
        # no options of its own (argv strings never contain NUL, so nothing looks like one).
        add_help=False,
        prefix_chars="\0",
    )
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for benchmarks/run.py")
    parser.set_defaults(run=run)


def suite_path(package_dir: Path = PACKAGE_DIR) -> Path | None:
    """benchmarks/run.py next to the package, or None when the package is installed alone."""
    candidate = package_dir.parent / "benchmarks" / "run.py"
    return candidate if candidate.is_file() else None


def run(args: argparse.Namespace) -> int:
    script = suite_path()
    if script is None:
        print(
            "bench: the benchmark suite ships with the source repository, not with the installed "
            f"package (looked for benchmarks/run.py next to {PACKAGE_DIR}).\n"
            "Clone the repository, install it with 'pip install -e .[bench]' and run "
            "'python -m mprs_plus bench' or 'python benchmarks/run.py' from the checkout.",
            file=sys.stderr,
        )
        return 2
    return subprocess.run([sys.executable, str(script), *args.rest]).returncode
