"""The package's import graph: no cycle, and every import goes down the layers of DESIGN.md's "Layer rules".

The modules are parsed with `ast`, never imported (fast, no cluster, no Megatron). Every import counts: at the
top of a module and inside functions or methods, relative ones resolved; a package's `__init__.py` is a module
of its own (`from yatt_ray.rollout import make_engine` imports `rollout/__init__.py`, while
`from yatt_ray.rollout import pool` imports `rollout/pool.py`). Imports under `if TYPE_CHECKING:` never run:
they count for the layers, not for cycles. Imports under `if __name__ == "__main__":` belong to the module run as
a script (`__main__`), not to the module: they count for neither.

The layers and the never-rules are read from DESIGN.md (section "Layer rules"), the one table of them: change
the rules there, and this test checks the code against the change.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "yatt_ray"
DESIGN = ROOT / "DESIGN.md"


@dataclass(frozen=True)
class Import:
    source: str  # module path under yatt_ray/, e.g. "train/kernels.py", "rollout/__init__.py"
    target: str
    line: int
    type_only: bool  # under `if TYPE_CHECKING:`


def module_paths() -> dict[str, str]:
    """Dotted name -> path under yatt_ray/ for every module of the package (a package: its `__init__.py`)."""
    names = {}
    for file in sorted(PACKAGE.rglob("*.py")):
        rel = file.relative_to(PACKAGE).as_posix()
        parts = ["yatt_ray", *file.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = rel
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _is_main_guard(test: ast.expr) -> bool:
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
    )


def _imports_in(tree: ast.AST):
    """(node, under TYPE_CHECKING) for every import statement, leaving out `if __name__ == "__main__":` blocks."""
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, type_only = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, type_only
            continue
        if isinstance(node, ast.If) and _is_main_guard(node.test):
            stack.extend((child, type_only) for child in node.orelse)
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend((child, True) for child in node.body)
            stack.extend((child, type_only) for child in node.orelse)
            continue
        stack.extend((child, type_only) for child in ast.iter_child_nodes(node))


def _owner(name: str, names: dict[str, str]) -> str | None:
    """The module `name` stands for: itself, or the longest dotted prefix that is a module of the package."""
    while name and name not in names:
        name = name.rpartition(".")[0]
    return name or None


def parse(source: str, filename: str) -> ast.Module:
    """`ast.parse`, once more after CPython 3.11's "AST constructor recursion depth mismatch" SystemError: its
    parser's depth counter is shared by every thread, and a thread an earlier test left running (a client's
    connection pool) can make one parse fail spuriously; the file itself parses."""
    try:
        return ast.parse(source, filename=filename)
    except SystemError:
        return ast.parse(source, filename=filename)


def package_imports() -> list[Import]:
    names = module_paths()
    found = []
    for name, rel in names.items():
        tree = parse((PACKAGE / rel).read_text(), rel)
        package = name if rel.endswith("__init__.py") else name.rpartition(".")[0]
        for node, type_only in _imports_in(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [_owner(alias.name, names) for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    anchor = ".".join(parts[: len(parts) - (node.level - 1)])
                    base = f"{anchor}.{base}" if base else anchor
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in names else _owner(base, names))
            for target in targets:
                if target is not None and target != name:
                    found.append(Import(rel, names[target], node.lineno, type_only))
    return list(dict.fromkeys(found))  # one entry per import statement and target


# ---------------------------------------------------------------------------------------------- cycles
def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph (its modules in order, the first again at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle():
    imports = [i for i in package_imports() if not i.type_only]
    edges: dict[str, set[str]] = {}
    for i in imports:
        edges.setdefault(i.source, set()).add(i.target)
    cycle = find_cycle(edges)
    if cycle:
        where = {(i.source, i.target): i.line for i in imports}
        steps = [f"{a}:{where[a, b]} imports {b}" for a, b in zip(cycle, cycle[1:])]
        pytest.fail("import cycle in yatt_ray/:\n  " + "\n  ".join(steps))


# ---------------------------------------------------------------------------------------------- layers
def layer_rules(text: str) -> tuple[list[list[str]], list[tuple[str, str]]]:
    """From DESIGN.md's "## Layer rules" section: the layers, highest first, each a list of units (a path under
    yatt_ray/, a folder ending in "/"), and the (from, to) pairs that never import, "*" for any module."""
    section = text.split("\n## Layer rules", 1)[1].split("\n## ", 1)[0]
    tables: list[list[list[str]]] = [[]]
    for line in section.splitlines():
        if not line.startswith("|"):
            if tables[-1]:
                tables.append([])
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if set("".join(cells)) <= set("-: "):
            continue  # the header's rule
        tables[-1].append([" ".join(re.findall(r"`([^`]+)`", c)) for c in cells])
    layers_table, never_table = [t[1:] for t in tables if t][:2]  # each without its header row
    layers = [row[1].split() for row in layers_table]
    never = [(a, b) for row in never_table for a in row[0].split() for b in row[1].split()]
    return layers, never


def names(unit: str, path: str) -> bool:
    """Whether `unit` (a module's path, or a folder ending in "/") holds the module at `path`."""
    return path == unit or (unit.endswith("/") and path.startswith(unit))


def unit_of(path: str, units: list[str]) -> str | None:
    """The most specific unit naming `path`: the path itself, else the deepest folder holding it."""
    matches = [u for u in units if names(u, path)]
    return max(matches, key=len, default=None)


def test_the_rules_parse_and_name_real_modules():
    layers, never = layer_rules(DESIGN.read_text())
    assert len(layers) >= 3 and never, "DESIGN.md's Layer rules section lost its tables"
    units = [u for layer in layers for u in layer]
    assert len(units) == len(set(units)), "a unit stands in two layers"
    paths = set(module_paths().values())
    for unit in units + [u for pair in never for u in pair if u != "*"]:
        assert any(names(unit, p) for p in paths), (
            f"DESIGN.md's Layer rules name {unit!r}, which is no module or folder of yatt_ray/"
        )


def test_every_module_has_a_layer():
    layers, _ = layer_rules(DESIGN.read_text())
    units = [u for layer in layers for u in layer]
    missing = sorted(p for p in module_paths().values() if unit_of(p, units) is None)
    assert not missing, f"modules with no layer in DESIGN.md's Layer rules (add them to a row): {missing}"


def test_imports_go_down_the_layers():
    layers, never = layer_rules(DESIGN.read_text())
    units = [u for layer in layers for u in layer]
    rank = {u: len(layers) - i for i, layer in enumerate(layers) for u in layer}  # higher layer, higher rank
    broken = []
    for i in package_imports():
        a, b = unit_of(i.source, units), unit_of(i.target, units)
        if a is None or b is None:
            continue  # test_every_module_has_a_layer names it
        if rank[b] > rank[a]:
            broken.append(f"{i.source}:{i.line} imports {i.target}: a higher layer ({b} over {a})")
        for src, dst in never:  # "*": any module outside dst (a folder's own modules import each other)
            outside = not names(dst, i.source)
            if (src == "*" and outside or names(src, i.source)) and names(dst, i.target):
                broken.append(f"{i.source}:{i.line} imports {i.target}: {src} never imports {dst}")
    assert not broken, "layer rules broken (DESIGN.md, Layer rules):\n  " + "\n  ".join(broken)
