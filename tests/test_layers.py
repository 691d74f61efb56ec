"""Layers point down only: no module of commpress imports a higher layer, and no modules
import each other in a cycle.

The layer table below is the one place the layers are declared; docs/architecture.md
("## Layers") shows the same table, and a test here checks that the two agree. Every import
counts: top-level, inside functions and under ``if TYPE_CHECKING:`` (a type-only import of a
higher layer still ties the lower one to it). Cycles are looked for among the imports that run
(``TYPE_CHECKING`` blocks left out), inside every package as well as between them.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = "commpress"
DOC = ROOT / "docs" / "architecture.md"

#: Lowest first. A unit (a top-level module or subpackage of commpress; ``commpress`` itself
#: is the package root, the public API) may import its own modules and any unit of a LOWER
#: row, never one of its own row or above: units in one row are independent of each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "procs", "report", "metrics"),
    ("units",),
    ("codecs",),
    ("collectives",),
    ("ddp",),
    ("commpress",),
    ("analysis", "testing", "perfmodel", "cluster"),
    ("demo", "bench"),
    ("experiments",),
    ("cli",),
    ("__main__",),
)

#: Module cycles not yet broken, each owned by a change in flight. Remove an entry when its
#: cycle is gone; a new cycle fails the test.
KNOWN_CYCLES: frozenset[frozenset[str]] = frozenset({
    # codecs/base <-> codecs/registry (function-level imports both ways): broken by the codec
    # traits work of issue 12, which edits codecs/base.py.
    frozenset({"commpress.codecs.base", "commpress.codecs.registry"}),
})

LEVEL: dict[str, int] = {unit: i for i, row in enumerate(LAYERS) for unit in row}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the commpress module imported
    line: int
    runtime: bool  # False under ``if TYPE_CHECKING:``
    where: str  # "top" or "function"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(
    node: ast.AST, *, runtime: bool, in_function: bool
) -> Iterator[tuple[ast.AST, bool, bool]]:
    for child in ast.iter_child_nodes(node):
        rt, fn = runtime, in_function
        if isinstance(node, ast.If) and _is_type_checking(node.test) and child in node.body:
            rt = False
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            fn = True
        yield child, rt, fn
        yield from _walk(child, runtime=rt, in_function=fn)


def imports_of(module: str, source: str, *, is_package: bool,
               modules: dict[str, Path]) -> list[Import]:
    """Every import of a commpress module in ``source`` (the text of ``module``);
    ``from pkg import name`` counts as an import of ``pkg.name`` where that is a module, else
    of ``pkg``."""
    out: list[Import] = []
    for node, runtime, in_function in _walk(ast.parse(source, module),
                                            runtime=True, in_function=False):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                targets.append(sub if sub in modules else source)
        for target in dict.fromkeys(targets):  # each module once per statement
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                out.append(Import(module, target, node.lineno, runtime,
                                  "function" if in_function else "top"))
    return out


def all_imports() -> list[Import]:
    modules = all_modules()
    return [imp for m, p in modules.items()
            for imp in imports_of(m, p.read_text(), is_package=p.name == "__init__.py",
                                  modules=modules)]


def upward_imports(imports: list[Import]) -> list[str]:
    bad = []
    for imp in imports:
        src, dst = unit_of(imp.module), unit_of(imp.target)
        if src == dst:
            continue
        if LEVEL[dst] >= LEVEL[src]:
            rel = "the same layer as" if LEVEL[dst] == LEVEL[src] else "a higher layer than"
            bad.append(f"{imp.module}:{imp.line} imports {imp.target} ({imp.where}-level): "
                       f"{dst!r} is in {rel} {src!r}")
    return bad


def module_cycles(imports: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), runtime imports."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.runtime and imp.target != imp.module:
            graph.setdefault(imp.module, set()).add(imp.target)
            graph.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sccs


def doc_layers() -> list[tuple[str, ...]]:
    """The rows of the table under ``## Layers`` in docs/architecture.md, lowest first."""
    text = DOC.read_text()
    match = re.search(r"^## Layers\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"{DOC} has no '## Layers' section"
    rows: dict[int, tuple[str, ...]] = {}
    for line in match.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            rows[int(cells[0])] = tuple(u.strip(" `") for u in cells[1].split(","))
    return [rows[i] for i in sorted(rows)]


# ------------------------------------------------------------------------------------ tests
def test_every_unit_has_a_layer() -> None:
    units = {unit_of(m) for m in all_modules()}
    missing = sorted(units - set(LEVEL))
    assert not missing, f"add these to LAYERS in {__file__} and docs/architecture.md: {missing}"
    assert len(LEVEL) == sum(len(row) for row in LAYERS), "a unit is listed twice"


def test_no_module_imports_a_higher_layer() -> None:
    bad = upward_imports(all_imports())
    assert not bad, "imports that point up or sideways:\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    cycles = [c for c in module_cycles(all_imports()) if frozenset(c) not in KNOWN_CYCLES]
    assert not cycles, "modules that import each other (runtime imports): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_no_cycles_between_packages() -> None:
    edges = {(unit_of(i.module), unit_of(i.target)) for i in all_imports()
             if unit_of(i.module) != unit_of(i.target)}
    both_ways = sorted({tuple(sorted(e)) for e in edges if (e[1], e[0]) in edges})
    assert not both_ways, f"units that import each other: {both_ways}"


def test_docs_show_the_same_layers() -> None:
    assert doc_layers() == [tuple(row) for row in LAYERS], (
        f"the '## Layers' table of {DOC} differs from LAYERS in {__file__}")


# ------------------------------------------------------------- the checks can fail at all
def _imports_from(source: str, module: str = "commpress.codecs.fake") -> list[Import]:
    return imports_of(module, source, is_package=False, modules=all_modules())


@pytest.mark.parametrize(("source", "caught"), [
    ("from commpress.perfmodel import model\n", True),
    ("def f():\n    from commpress.cli.table import render_table\n", True),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from commpress.ddp import x\n",
     True),
    ("from commpress.errors import CommpressError\n", False),
    ("from . import registry\n", False),
])
def test_upward_import_is_caught(source: str, caught: bool) -> None:
    assert bool(upward_imports(_imports_from(source))) is caught


def test_cycle_is_caught() -> None:
    imports = [Import("commpress.a.x", "commpress.a.y", 1, True, "function"),
               Import("commpress.a.y", "commpress.a.x", 1, True, "top"),
               Import("commpress.a.y", "commpress.a.z", 1, True, "top"),
               Import("commpress.a.z", "commpress.a.x", 1, False, "top")]
    assert module_cycles(imports) == [["commpress.a.x", "commpress.a.y"]]
