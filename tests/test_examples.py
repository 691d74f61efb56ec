"""Every program in examples/ runs as its header says, and the docs quote them verbatim.

An example starts with two comment lines: its path, and ``# run: <command>`` where the command
is ``python examples/X.py`` or ``torchrun --nproc_per_node N examples/X.py``. A Markdown code
block (README.md, docs/*.md) whose first line is ``# examples/X.py`` must be that file's exact
text, so a snippet a user copies is a program the tests ran.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(# examples/[^\n]+\.py\n.*?)```", re.S)
#: A quoted example followed by "prints" and a plain code block: the output the docs show.
PRINTS = re.compile(r"```python\n# (examples/[^\n]+\.py)\n.*?```\s*prints\s*```\n(.*?)```", re.S)


def _documented_output(path: Path) -> list[str]:
    """Lines the docs say ``path`` prints (deterministic examples only)."""
    lines: list[str] = []
    for doc in DOCS:
        for name, shown in PRINTS.findall(doc.read_text()):
            if ROOT / name == path:
                lines += [line for line in shown.splitlines() if line.strip()]
    return lines


def _run_command(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    assert lines[0] == f"# examples/{path.name}", f"{path.name}: first line must name the file"
    assert lines[1].startswith("# run: "), f"{path.name}: second line must say how to run it"
    argv = shlex.split(lines[1][len("# run: "):])
    assert argv[-1] == f"examples/{path.name}", argv
    if argv[0] == "python":
        return [sys.executable, str(path)]
    assert argv[0] == "torchrun" and argv[1] == "--nproc_per_node", argv
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", argv[2], str(path)]


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 3


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        _run_command(path), cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.strip(), f"{path.name} printed nothing"
    assert "Traceback" not in proc.stderr, proc.stderr
    printed = (proc.stdout + proc.stderr).splitlines()
    for line in _documented_output(path):
        assert line in printed, f"the docs say {path.name} prints {line!r}; it printed:\n" + (
            "\n".join(printed)
        )


def test_docs_quote_examples_verbatim() -> None:
    quoted = set()
    for doc in DOCS:
        for block in BLOCK.findall(doc.read_text()):
            name = block.splitlines()[0][len("# "):]
            path = ROOT / name
            assert path.exists(), f"{doc.name} quotes {name}, which does not exist"
            assert block == path.read_text(), f"{doc.name}'s copy of {name} differs from the file"
            quoted.add(path)
    assert quoted >= {ROOT / "examples" / n for n in
                      ("ddp_training.py", "compressed_collectives.py", "codec_basics.py")}


def _module_level_calls(tree: ast.Module) -> list[str]:
    """Names of the calls made by a module's top-level code outside ``if __name__ == ...``."""
    calls = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test):
            continue
        calls += [ast.unparse(c.func) for c in ast.walk(node) if isinstance(c, ast.Call)]
    return calls


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_distributed_examples_exit_cleanly(path: Path) -> None:
    """A program that joins a process group trains in a function and destroys the group after
    it returns: a DDP model (or a tensor a gloo collective used) held at module level outlives
    ``destroy_process_group``, and gloo may then abort the process at interpreter exit
    (docs/ddp.md, "Exit cleanly")."""
    text = path.read_text()
    if "init_process_group" not in text:
        pytest.skip("not a distributed program")
    tree = ast.parse(text)
    top = _module_level_calls(tree)
    assert not any(("init_process_group" in c or "DistributedDataParallel" in c
                    or c.startswith(("commpress.", "torch.")))
                   for c in top), f"{path.name} does work at module level: {top}"
    main = [n for n in tree.body if isinstance(n, ast.If) and "__name__" in ast.unparse(n.test)]
    assert len(main) == 1, f"{path.name} needs one `if __name__ == \"__main__\":` block"
    lines = [ast.unparse(s) for s in main[0].body]
    assert lines[-1] == "dist.destroy_process_group()", lines
    assert any(isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
               and isinstance(s.value.func, ast.Name) for s in main[0].body[:-1]), (
        f"{path.name}: the work runs in a function called before destroy_process_group")
