"""``commpress bench SUITE``: benchmarks, one module per suite under ``commpress.bench``.

Each module named in :data:`SUITES` exposes ``add_parser(subparsers)`` like a CLI command.
"""

from __future__ import annotations

import argparse
import importlib

#: Benchmark suite modules under ``commpress.bench``.
SUITES: list[str] = [
    "codecs",
    "allreduce",
    "lossless",
    "ddp",
]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks (codecs, allreduce, lossless, ddp) measured side by side in one run",
    )
    suites = p.add_subparsers(dest="suite", metavar="SUITE")
    for name in SUITES:
        importlib.import_module(f"commpress.bench.{name}").add_parser(suites)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
