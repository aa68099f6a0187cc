"""``timeline TRACE.json [-o PAGE.html]``: draw a timeline that ``stats().write_timeline()``
wrote as a self-contained page (inline SVG: no script, nothing fetched, opens offline in
any browser). ``--start``/``--end`` (ms from the service's start) show a window of it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "timeline",
        help="draw a timeline written by stats().write_timeline() as a self-contained HTML page",
        description=__doc__,
    )
    parser.add_argument("trace", help="the timeline's JSON file")
    parser.add_argument("-o", "--output", help="the page to write (default: TRACE with .html)")
    parser.add_argument("--start", type=float, default=None, help="ms from the service's start where the window begins")
    parser.add_argument("--end", type=float, default=None, help="ms from the service's start where the window ends")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..timeline import render_html

    try:
        with open(args.trace) as f:
            timeline = json.load(f)
        events = timeline["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"timeline: {args.trace} is not a trace-event JSON file ({exc})", file=sys.stderr)
        return 2
    if not isinstance(events, list):
        print(f"timeline: {args.trace} has no list of traceEvents", file=sys.stderr)
        return 2
    out = Path(args.output) if args.output else Path(args.trace).with_suffix(".html")
    out.write_text(render_html(timeline, args.start, args.end))
    print(out)
    return 0
