"""``python -m mprs_plus <command>``: demo, explain, bench, timeline. ``--help`` on each."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Iterator


def build_parser() -> argparse.ArgumentParser:
    from ._cli import bench, demo, explain, timeline

    parser = argparse.ArgumentParser(
        prog="python -m mprs_plus",
        description="Commands of mprs_plus, the multiprocessing reading service for DataLoader2. "
        "Each command has --help.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (demo, explain, bench, timeline):
        module.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    with _torchdata_banner_quieted():
        args = build_parser().parse_args(argv)
        return int(args.run(args) or 0)


_BANNER_MODULES = ("torchdata.datapipes", "torchdata.dataloader2")


@contextlib.contextmanager
def _torchdata_banner_quieted() -> Iterator[None]:
    """Hide the deprecation banner torchdata prints when first imported, for the length of
    a command: in this process, and in the processes it starts (spawned children read
    ``PYTHONWARNINGS``). Only that warning, a ``UserWarning`` from the top-level code of
    the two packages that print it; a program that imports mprs_plus itself still sees it.
    """
    previous = os.environ.get("PYTHONWARNINGS")
    quiet = ",".join(f"ignore::UserWarning:{module}" for module in _BANNER_MODULES)
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [previous, quiet]))
    try:
        with warnings.catch_warnings():
            for module in _BANNER_MODULES:
                warnings.filterwarnings("ignore", category=UserWarning, module=module.replace(".", r"\.") + r"\Z")
            yield
    finally:
        if previous is None:
            os.environ.pop("PYTHONWARNINGS", None)
        else:
            os.environ["PYTHONWARNINGS"] = previous


if __name__ == "__main__":
    sys.exit(main())
