"""A ceiling on long functions in the library: read with `ast`, nothing of yatt_ray imported.

A function's length counts from its `def` line to the last line of its body, docstring included. A few may
run past `LIMIT` lines (a long formula is clearer whole); past `ALLOWED` of them, split one by meaning:
named helpers that fit on a screen, each with its docstring.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit.test_imports import parse

LIMIT = 60  # lines
ALLOWED = 5  # functions over LIMIT in the whole package
PACKAGE = Path(__file__).resolve().parents[2] / "yatt_ray"


def long_functions(root: Path = PACKAGE, limit: int = LIMIT) -> list[tuple[int, str]]:
    """(lines, "path:line name") of every function or method longer than `limit` lines, longest first."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    where = f"{path.relative_to(root.parent)}:{node.lineno} {node.name}"
                    found.append((lines, where))
    return sorted(found, reverse=True)


def test_few_functions_are_longer_than_a_screen():
    found = long_functions()
    listing = "\n".join(f"  {lines:4d} lines  {where}" for lines, where in found)
    assert len(found) <= ALLOWED, (
        f"{len(found)} functions in yatt_ray/ are over {LIMIT} lines (at most {ALLOWED} may be); split one by "
        f"meaning into named helpers:\n{listing}"
    )


def test_the_counter_counts_from_def_to_the_last_line(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    (package / "m.py").write_text(f'def long():\n    """doc"""\n{body}\n\n\ndef short():\n    pass\n')
    assert long_functions(package) == [(62, "pkg/m.py:1 long")]
    assert long_functions(package, limit=62) == []
