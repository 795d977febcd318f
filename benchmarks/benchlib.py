"""What every script in ``benchmarks/`` shares: the ``--json PATH`` option, progress lines, and the report.

Each script prints progress to stderr as it goes (which case, which repeat), then its results table to stdout. The
results are written as JSON only to the path given with ``--json``; without it, the JSON goes to stdout after the
table and no file is written (the committed ``benchmarks/results/*.json`` change only when asked).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="write the results as JSON to PATH (without it, they are printed and nothing is written)")


def progress(message: str) -> None:
    """One progress line on stderr, flushed at once (the scripts run for minutes)."""
    print(message, file=sys.stderr, flush=True)


def load_average_line(results: dict) -> str:
    """Record the 1-minute load average now as ``results["load_average_after"]`` and return the table's line with it
    and ``results["load_average_before"]`` (the machine's load during the run)."""
    results["load_average_after"] = os.getloadavg()[0]
    return (f"1-minute load average {results['load_average_before']:.2f} before, "
            f"{results['load_average_after']:.2f} after, on {os.cpu_count()} cores")


def report(table: str, results: dict, path: Path | None) -> None:
    """Print ``table``; write ``results`` to ``path`` as JSON, or print them when no path was given."""
    print(table, flush=True)
    text = json.dumps(results, indent=2) + "\n"
    if path is None:
        print("\nresults (not written; pass --json PATH to save them):")
        print(text, end="", flush=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    progress(f"results written to {path}")
