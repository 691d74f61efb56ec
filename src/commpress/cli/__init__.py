"""The ``commpress`` command line: one entry point, one module per sub-command.

Each module named in :data:`COMMANDS` exposes ``add_parser(subparsers)``, which registers its
sub-command and sets ``func`` (taking the parsed arguments, returning an exit code).

The command modules import their subsystem (``commpress.perfmodel``, ``commpress.cluster``,
``commpress.demo``, ``commpress.experiments``) inside ``add_parser``'s defaults or ``run``, not
at the top: every command's parser is built on each call, and loading all subsystems up front
would cost about a second of import time (the cluster package alone ~0.8 s cumulative on the
2-core container) for commands that use none of them. These are the function-level imports
of the CLI; the layers (docs/architecture.md) allow them anyway, as cli is the top layer.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from commpress.errors import CommpressError

#: Sub-command modules under ``commpress.cli``, in the order ``--help`` lists them.
COMMANDS: list[str] = [
    "codecs_cmd",
    "bench_cmd",
    "cluster_cmd",
    "launch_cmd",
    "capture_cmd",
    "analyze_cmd",
    "predict_cmd",
    "sweep_cmd",
    "advise_cmd",
    "validate_cmd",
    "demo_cmd",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="commpress",
        description="Compression of gradients and activations for distributed PyTorch training.",
    )
    from commpress import __version__

    parser.add_argument("--version", action="version", version=f"commpress {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"commpress.cli.{name}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except CommpressError as exc:
        print(f"commpress: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("commpress: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
