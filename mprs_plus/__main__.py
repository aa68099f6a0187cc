"""``python -m mprs_plus <command>``: demo, explain, bench. ``--help`` on each."""

from __future__ import annotations

import argparse
import sys

from ._cli import bench, demo, explain


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mprs_plus",
        description="Commands of mprs_plus, the multiprocessing reading service for DataLoader2. "
        "Each command has --help.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (demo, explain, bench):
        module.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
