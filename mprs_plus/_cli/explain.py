"""``explain MODULE:FACTORY``: print the plan of a user's pipeline without running it."""

from __future__ import annotations

import argparse
from typing import Any


def register(commands: Any) -> None:
    parser = commands.add_parser("explain", help="print where each DataPipe of a pipeline would run")
    parser.add_argument("target", help="MODULE:FACTORY, a function returning the DataPipe")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    raise SystemExit("explain: not implemented yet")
