"""The configuration reference (docs/configuration.md), built from the code: `python -m yatt_ray.config --reference`.

Each key's default and type come from the dataclasses in `yatt_ray.config`; its description is the `#` comment
written where the default is declared: the comment lines right above the field plus any comment on the field's
own lines. A section's introduction is its class docstring. Nothing here is written by hand twice, so the page
cannot drift from the code (tests/unit/test_config_reference.py compares the two).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import tokenize
import types
import typing
from dataclasses import dataclass
from typing import Any

from yatt_ray import config as config_module

DOC_PATH = "docs/configuration.md"
COMMAND = "python -m yatt_ray.config --reference > docs/configuration.md"
PRAGMAS = ("fmt:", "type:", "noqa", "pragma:")  # tool comments, not descriptions


@dataclass(frozen=True)
class KeyDoc:
    key: str  # dotted, e.g. "reward.genrm.replicas"
    type: str  # as a reader writes it: "int or null", "one of `full`, `partial`"
    default: str  # as YAML / JSON: null, true, [], "runs/grpo"
    comment: str


@dataclass(frozen=True)
class SectionDoc:
    name: str  # dotted, e.g. "reward.genrm"
    intro: str  # the section class's docstring
    keys: list[KeyDoc]


def field_comments(source: str) -> dict[tuple[str, str], str]:
    """(class name, field name) -> the field's comment, for every annotated field of every class in `source`:
    the run of comment-only lines right above the field, then the comments on the field's own lines (a
    trailing comment, or comments inside a value that spans lines), joined by spaces. Tool pragmas are left
    out."""
    comments: dict[int, str] = {}  # line -> comment text
    alone: set[int] = set()  # lines that hold nothing but a comment
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            line = tok.start[0]
            comments[line] = tok.string.lstrip("#").strip()
            if not tok.line[: tok.start[1]].strip():
                alone.add(line)
    out: dict[tuple[str, str], str] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            first, last = stmt.lineno, stmt.end_lineno or stmt.lineno
            above: list[int] = []
            line = first - 1
            while line in alone:
                above.insert(0, line)
                line -= 1
            lines = above + [n for n in range(first, last + 1) if n in comments]
            parts = [comments[n] for n in lines if not comments[n].startswith(PRAGMAS)]
            out[(node.name, stmt.target.id)] = " ".join(p for p in parts if p)
    return out


def type_text(hint: Any) -> str:
    """A field's type as the reference shows it: Literal choices listed, Optional as "or null"."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{json.dumps(a) if a == '' else a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        text = " or ".join(type_text(a) for a in inner)
        return text + " or null" if type(None) in args else text
    if origin is list:
        return f"list of {type_text(args[0])}"
    if origin is dict:
        return "mapping"
    return getattr(hint, "__name__", str(hint))


def default_text(value: Any) -> str:
    """A default as it would be written in a YAML config (JSON is YAML): null, true, [], "text", 0.001."""
    return json.dumps(value)


def sections(root: type = config_module.Config) -> list[SectionDoc]:
    """Every config section under `root` in declaration order, a nested section right after its parent."""
    comments = field_comments(inspect.getsource(config_module))
    out: list[SectionDoc] = []

    def walk(cls: type, instance: Any, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        keys, nested = [], []
        for f in dataclasses.fields(cls):
            value = getattr(instance, f.name)
            if dataclasses.is_dataclass(value):
                nested.append((hints[f.name], value, prefix + f.name))
                continue
            comment = comments.get((cls.__name__, f.name), "")
            keys.append(KeyDoc(prefix + f.name, type_text(hints[f.name]), default_text(value), comment))
        if prefix:
            out.append(SectionDoc(prefix.rstrip("."), inspect.cleandoc(cls.__doc__ or ""), keys))
        for hint, value, name in nested:
            walk(hint, value, name + ".")

    walk(root, root(), "")
    return out


def section_summaries() -> list[tuple[str, str]]:
    """(section, the first sentence of its docstring, up to its colon when that is long): what `--help` lists."""
    out = []
    for s in sections():
        first = " ".join(s.intro.split()).split(". ")[0].rstrip(".")
        out.append((s.name, first if len(first) <= 90 else first.split(": ")[0]))
    return out


def _cell(text: str) -> str:
    """`text` in a table cell: pipes escaped; outside code spans also `<` (not an HTML tag) and `*` (not
    emphasis)."""
    parts = text.replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace("*", "\\*")
    return "`".join(parts)


def reference_markdown() -> str:
    """The whole page: a header, a list of sections, then a table per section."""
    docs = sections()
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated from yatt_ray/config.py by `{COMMAND}`; edit the comments there, not this page. -->",
        "",
        "Every key, its type, its default and what it does. A config is a YAML file of these sections (see",
        "`examples/configs/`); any key can be overridden on an example's command line as `section.key=value`",
        "(`python examples/grpo.py train.steps=10 reward.genrm.replicas=2`), the value read as YAML",
        "(`null`, `true`, `[a, b]`), or passed to `yatt_ray.fit()` as a nested dict or a `yatt_ray.Config`.",
        "",
        "Sections: " + ", ".join(f"[`{s.name}`](#{s.name.replace('.', '')})" for s in docs) + ".",
    ]
    for s in docs:
        lines += ["", f"## {s.name}", ""]
        if s.intro:
            lines += [s.intro, ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for k in s.keys:
            lines.append(f"| `{k.key}` | {_cell(k.type)} | `{_cell(k.default)}` | {_cell(k.comment)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    """`python -m yatt_ray.config --reference`: print the reference to stdout."""
    if argv != ["--reference"]:
        print(f"usage: python -m yatt_ray.config --reference   (prints the Markdown of {DOC_PATH})")
        return 2
    print(reference_markdown(), end="")
    return 0


__all__ = ["KeyDoc", "SectionDoc", "field_comments", "reference_markdown", "sections"]
