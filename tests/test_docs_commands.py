"""The command outputs the docs show are what the commands print today (issue 14).

In README.md and docs/*.md, a fenced block line ``$ commpress ARGS`` (continued over lines
ending in ``\\``) followed by output lines is a *documented run*. This test runs every
documented run of a deterministic command (``predict``, ``sweep``, ``advise``, ``codecs``;
the others measure something) and checks that each output line the docs show appears, in
order, in what the command prints now. A line ``...`` in the output elides lines; a command
containing ``...`` is an abbreviation of the one before and is not run.

When a change legitimately moves the numbers, rewrite the documented outputs with::

    PYTHONPATH=src python tests/test_docs_commands.py --regenerate

(blocks with ``...`` elisions are left alone: fix them by hand), and review the diff.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DETERMINISTIC = ("predict", "sweep", "advise", "codecs")
_FENCE = re.compile(r"^\s*```")


@dataclass
class Run:
    path: Path
    line: int  # 0-based index of the ``$`` line
    end: int  # index after the last output line
    argv: list[str]
    shown: list[str]

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line + 1}"


def documented_runs(path: Path) -> list[Run]:
    lines = path.read_text().splitlines()
    runs: list[Run] = []
    inside = False
    i = 0
    while i < len(lines):
        if _FENCE.match(lines[i]):
            inside = not inside
            i += 1
            continue
        if not (inside and lines[i].startswith("$ commpress ")):
            i += 1
            continue
        start = i
        command = lines[i][2:]
        while command.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            command = command.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        out_start = i
        while i < len(lines) and not _FENCE.match(lines[i]) and not lines[i].startswith("$ "):
            i += 1
        command = command.split("  #", 1)[0]
        argv = shlex.split(command)
        if "..." in argv or argv[1] not in DETERMINISTIC:
            continue
        runs.append(Run(path, start, i, argv, lines[out_start:i]))
    return runs


def run_command(argv: list[str], cwd: Path) -> list[str]:
    """Run in ``cwd`` (an empty directory) holding a link to the repository's ``examples/``,
    so that documented runs can name its files (``--model examples/models/vgg19.py:vgg19``)."""
    link = cwd / "examples"
    if not link.exists():
        link.symlink_to(ROOT / "examples", target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200"}
    env.pop("COMMPRESS_CODEC_SPEEDS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "commpress", *argv[1:]], cwd=cwd, env=env,
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"{shlex.join(argv)} failed:\n{proc.stderr[-2000:]}"
    return proc.stdout.splitlines()


def missing_lines(shown: list[str], printed: list[str]) -> list[str]:
    """Lines of ``shown`` (``...`` elides) not found in ``printed`` in the same order."""
    missing: list[str] = []
    at = 0
    for line in shown:
        if line.strip() in ("", "..."):
            continue
        try:
            at = printed.index(line.rstrip(), at) + 1
        except ValueError:
            missing.append(line)
    return missing


ALL_RUNS = [run for path in DOCS for run in documented_runs(path)]


def test_the_docs_have_documented_runs() -> None:
    assert any(run.argv[1] == "predict" for run in ALL_RUNS), "no documented predict run found"


@pytest.mark.parametrize("run", ALL_RUNS, ids=[run.where for run in ALL_RUNS])
def test_documented_output_is_what_the_command_prints(run: Run, tmp_path: Path) -> None:
    printed = run_command(run.argv, tmp_path)
    missing = missing_lines(run.shown, printed)
    assert not missing, (
        f"{run.where}: `{shlex.join(run.argv)}` no longer prints these documented lines:\n"
        + "\n".join(missing) + "\n--- it prints:\n" + "\n".join(printed)
        + "\n(regenerate: PYTHONPATH=src python tests/test_docs_commands.py --regenerate)"
    )


def regenerate(tmp: Path) -> None:
    for path in DOCS:
        runs = [r for r in documented_runs(path) if "..." not in [s.strip() for s in r.shown]]
        if not runs:
            continue
        lines = path.read_text().splitlines()
        for run in reversed(runs):  # later blocks first: indices stay valid
            printed = run_command(run.argv, tmp)
            out_start = run.end - len(run.shown)
            lines[out_start:run.end] = printed
            print(f"{run.where}: {len(printed)} lines")
        path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit(__doc__)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        regenerate(Path(tmp))
