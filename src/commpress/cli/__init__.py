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
import difflib
import importlib
import os
import re
import select
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from commpress.errors import ConfigError, exit_status

#: Sub-command modules under ``commpress.cli``, in the order ``--help`` lists them.
COMMANDS: list[str] = [
    "codecs_cmd",
    "bench_cmd",
    "cluster_cmd",
    "launch_cmd",
    "capture_cmd",
    "analyze_cmd",
    "calibrate_cmd",
    "predict_cmd",
    "sweep_cmd",
    "advise_cmd",
    "validate_cmd",
    "demo_cmd",
]


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the text already states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "%(default)" in text
            or default in (None, False, argparse.SUPPRESS, [], "")
            or action.option_strings == []
            or isinstance(action, (argparse._StoreTrueAction, argparse._VersionAction))
        ):
            return text
        shown = f"{default:g}" if isinstance(default, float) else str(default)
        if f"({shown}" in text or f"{shown})" in text or "default" in text.lower():
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse with "did you mean" for a mistyped command or choice, and defaults in --help."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        match = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if match:
            choices = re.findall(r"'([^']*)'", match.group(2))
            close = difflib.get_close_matches(match.group(1), choices, n=1, cutoff=0.5)
            if close:
                message += f"; did you mean {close[0]!r}?"
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="commpress",
        description="Compression of gradients and activations for distributed PyTorch training.",
    )
    from commpress import __version__

    parser.add_argument("--version", action="version", version=f"commpress {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"commpress.cli.{name}").add_parser(sub)
    return parser


#: Exit status after the reader of our standard output went away (``commpress codecs | head``):
#: 128 + SIGPIPE, what a shell reports for a process that a closed pipe ended.
BROKEN_PIPE_STATUS = 141


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit status (the console script passes it to ``sys.exit``).

    Every command shares the same handling of a closed output pipe: when the reader leaves
    early, the rest of the output is dropped and the exit is quiet, with status
    :data:`BROKEN_PIPE_STATUS`, instead of a ``BrokenPipeError`` traceback.
    """
    try:
        try:
            return _run(argv)
        finally:
            # Flush here, inside the try (also when argparse exits after --help/--version): a
            # pipe closed while the last buffered block is pending would otherwise fail in the
            # interpreter's own flush at exit, outside our reach.
            sys.stdout.flush()
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise  # a broken pipe elsewhere (a worker's socket, say) is a real error
        _silence_stdout()
        return BROKEN_PIPE_STATUS


def _stdout_reader_gone() -> bool:
    """Whether standard output is a pipe or socket whose reading end has been closed."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    if not hasattr(select, "poll"):  # pragma: no cover - not on Linux/macOS
        return True
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    events = poller.poll(0)
    return any(ev & (select.POLLERR | select.POLLHUP) for _fd, ev in events)


def _silence_stdout() -> None:
    """Point file descriptor 1 at the null device, so the flush at exit finds nowhere to fail
    (Python's documented handling of ``SIGPIPE``/``EPIPE``)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a real file (captured by a test harness): nothing is flushed to fd 1
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


#: Output arguments holding a file path: ``--json``, ``--profile``, ``--save`` (predict's
#: speed table), ``--emit-policy`` (advise's policy file), ``--png`` (analyze's figure), and
#: ``--out`` where the command says so (``set_defaults(out_kind="file")``; else ``--out`` is a
#: directory made with its parents)
_OUTPUT_ARGS = ("json", "profile", "save", "emit_policy", "png", "out")

#: Output files whose missing directories the command makes (``SpeedTable.save``, analyze's
#: figure)
_FILES_WITH_PARENTS = ("save", "png")


def check_output_paths(args: argparse.Namespace) -> None:
    """Refuse an output path that cannot be written before the command runs (a benchmark
    would otherwise fail at its very end): a file must be writable if it exists, else its
    directory must exist and be writable; a directory must not be a file, and its nearest
    existing ancestor must be a directory. Ranks other than 0 of a launched job (``RANK``)
    write nothing and are not checked."""
    if os.environ.get("RANK", "0") != "0":
        return
    for name in _OUTPUT_ARGS:
        value = getattr(args, name, None)
        if not isinstance(value, str) or not value:
            continue
        path = Path(value)
        flag = f"--{name.replace('_', '-')}"
        if name != "out" or getattr(args, "out_kind", "dir") == "file":
            if path.is_dir():
                raise ConfigError(f"{flag} {value}: is a directory, not a file")
            if path.exists():
                if not os.access(path, os.W_OK):
                    raise ConfigError(f"{flag} {value}: is not writable")
                continue
            parent = path.parent
            if parent.exists() and not parent.is_dir():
                raise ConfigError(f"{flag} {value}: {str(parent)!r} is not a directory")
            if name in _FILES_WITH_PARENTS and not parent.exists():
                _check_creatable(flag, value, parent)
                continue
            if not parent.is_dir():
                raise ConfigError(f"{flag} {value}: directory {str(parent)!r} does not exist")
            if not os.access(parent, os.W_OK):
                raise ConfigError(f"{flag} {value}: directory {str(parent)!r} is not writable")
            continue
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{flag} {value}: exists and is not a directory")
        _check_creatable(flag, value, path)


def _check_creatable(flag: str, value: str, path: Path) -> None:
    """Refuse a directory ``path`` that cannot be made with its parents: its nearest existing
    ancestor must be a writable directory."""
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"{flag} {value}: cannot create it under {str(ancestor)!r}")
    if not path.exists() and not os.access(ancestor, os.W_OK):
        raise ConfigError(f"{flag} {value}: cannot create it under {str(ancestor)!r} (not "
                          "writable)")


def _command_parser(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.ArgumentParser:
    """The innermost (sub-)command parser that ``args`` went through: ``commpress bench
    codecs``'s, not ``bench``'s; ``parser`` itself when no command was chosen."""
    while True:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = getattr(args, action.dest, None) if action.dest else None
                if chosen in action.choices:
                    parser = action.choices[chosen]
                    break
        else:
            return parser


def _reject_unknown(parser: argparse.ArgumentParser, args: argparse.Namespace,
                    extra: list[str]) -> NoReturn:
    """Report arguments no parser took with the usage of the command they were given to (not
    the top-level usage argparse would print), and a near miss among its options."""
    target = _command_parser(parser, args)
    message = f"unrecognized arguments: {' '.join(extra)}"
    options = [o for a in target._actions for o in a.option_strings if o.startswith("--")]
    for word in extra:
        if word.startswith("--"):
            close = difflib.get_close_matches(word.partition("=")[0], options, n=1, cutoff=0.75)
            if close:
                message += f"; did you mean {close[0]}?"
                break
    target.error(message)


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        _reject_unknown(parser, args, extra)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2

    def command() -> int:
        precheck = getattr(args, "precheck", None)
        if precheck is not None:  # a command's own checks of its options, before the paths
            precheck(args)
        check_output_paths(args)
        return int(args.func(args) or 0)

    try:
        return exit_status(command)
    except KeyboardInterrupt:
        print("commpress: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
