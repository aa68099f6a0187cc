"""``bench``: run the benchmark suite of a source checkout (benchmarks/run.py)."""

from __future__ import annotations

import argparse
from typing import Any


def register(commands: Any) -> None:
    parser = commands.add_parser("bench", help="run the benchmark suite")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for benchmarks/run.py")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    raise SystemExit("bench: not implemented yet")
