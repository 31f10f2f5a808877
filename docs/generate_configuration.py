#!/usr/bin/env python
"""Write ``docs/configuration.md`` from the config dataclasses themselves, so it cannot drift.

    python docs/generate_configuration.py          # rewrite docs/configuration.md
    python docs/generate_configuration.py --check  # exit 1 if the committed page is stale

Every field's type and default come from the dataclass, its text from the comments beside and
above it in ``d3d_jax/config/*.py``, and each command's flags from its own argparse parser (a
flag whose destination is a dotted key sets that field).  ``tests/test_docs.py`` checks that the
committed page equals :func:`render`'s output.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import inspect
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"

# command line -> (config class, how its parser is built)
COMMANDS = (
    ("train/train_drafter.py", "TrainRunConfig", None),
    ("train/prune_drafter.py", "PruneRunConfig", None),
    ("train/regenerate_data.py", "RegenerateConfig", None),
    ("train/pipeline.py", "PipelineConfig", None),
    ("infer/generate.py", "GenerateConfig", ("infer/generate.py", "add_arguments")),
    ("infer/serve.py", "ServeConfig", ("d3d_jax.serving.server", "add_arguments")),
    ("infer/bench.py eval", "EvalConfig", ("d3d_jax.bench.evaluation.cli", "add_arguments")),
)


def load_parser_module(where: str):
    """A module by dotted name, or a script of this repository by path."""
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(where).stem + "_docs", ROOT / where)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(where)


def command_parser(build) -> argparse.ArgumentParser | None:
    if build is None:
        return None
    where, func = build
    return getattr(load_parser_module(where), func)(argparse.ArgumentParser())


def _comments(source: str) -> dict[int, str]:
    """``{line: comment text}`` of every comment in ``source``."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


@dataclasses.dataclass
class Field:
    name: str
    type: str
    default: str
    doc: str
    section: type | None  # a nested config section's class


def _default(node: ast.expr | None, classes: dict[str, type]) -> tuple[str, type | None]:
    if node is None:
        return "required", None
    if isinstance(node, ast.Call) and ast.unparse(node.func) in ("dataclasses.field", "field"):
        for kw in node.keywords:
            if kw.arg == "default_factory":
                name = ast.unparse(kw.value)
                if name in classes:
                    return "", classes[name]
                return {"dict": "{}", "list": "[]", "tuple": "()"}.get(name, f"{name}()"), None
            if kw.arg == "default":
                return ast.unparse(kw.value), None
    return ast.unparse(node), None


def fields_of(cls: type) -> list[Field]:
    """The dataclass's fields in declaration order, each with the comments that document it."""
    module = sys.modules[cls.__module__]
    source = Path(inspect.getsourcefile(module)).read_text(encoding="utf-8")
    lines, comments = source.splitlines(), _comments(source)
    tree = ast.parse(source)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    classes = {name: obj for name, obj in vars(module).items() if dataclasses.is_dataclass(obj)}
    declared = {f.name for f in dataclasses.fields(cls)}
    out = []
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and stmt.target.id in declared):
            continue
        above, n = [], stmt.lineno - 1
        while n >= 1 and lines[n - 1].strip().startswith("#"):
            above.insert(0, comments[n])
            n -= 1
        beside = comments.get(stmt.end_lineno, "")
        default, section = _default(stmt.value, classes)
        out.append(Field(stmt.target.id, ast.unparse(stmt.annotation), default,
                         " ".join(p for p in above + [beside] if p), section))
    return out


def _summary(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    if doc.startswith(cls.__name__ + "("):  # dataclasses' generated signature is no summary
        return ""
    return " ".join(doc.split("\n\n")[0].split()).replace("``", "`")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _anchor(cls: type) -> str:
    return cls.__name__.lower()


def _flags(parser: argparse.ArgumentParser | None) -> dict[str, list[str]]:
    """``{dotted key: [flags]}`` of the parser's flags that set a config field."""
    out: dict[str, list[str]] = {}
    if parser is None:
        return out
    for action in parser._actions:
        if "." in action.dest and action.option_strings:
            out.setdefault(action.dest, []).extend(action.option_strings)
    return out


def render() -> str:
    config = importlib.import_module("d3d_jax.config")
    out = ["# Configuration reference", "",
           "<!-- Generated by docs/generate_configuration.py from the config dataclasses in d3d_jax/config/ "
           "and the commands' parsers. Do not edit: change the code's comments and run "
           "`python docs/generate_configuration.py`. tests/test_docs.py checks this page is current. -->", "",
           "Every command that takes a config reads typed dataclasses: YAML files (`--config FILE`, "
           "repeatable, later files win; a YAML may `include:` others), then the command's flags, then "
           "dotted `key=value` overrides (`train.steps=200`, `decoder.num_slots=4`). Each value is "
           "converted to the field's type and checked at load; a bad one stops the command with one "
           "line naming the key. A default of `None` is derived where the field says how.", "",
           "| command | config | sections |", "|---|---|---|"]
    seen: list[type] = []
    per_command = []
    for command, name, build in COMMANDS:
        cls = getattr(config, name)
        fields = fields_of(cls)
        sections = [f for f in fields if f.section is not None]
        links = ", ".join(f"[`{f.name}`](#{_anchor(f.section)})" for f in sections)
        out.append(f"| `{command}` | [`{name}`](#{_anchor(cls)}) | {links or '—'} |")
        per_command.append((command, cls, fields, _flags(command_parser(build))))
    out.append("")
    for command, cls, fields, flags in per_command:
        out += _class_table(cls, fields, f"`{command}` reads `{cls.__name__}`.", flags)
        seen.append(cls)
    todo = [f.section for _, _, fields, _ in per_command for f in fields if f.section is not None]
    while todo:
        cls = todo.pop(0)
        if cls in seen:
            continue
        seen.append(cls)
        fields = fields_of(cls)
        out += _class_table(cls, fields, "", {})
        todo += [f.section for f in fields if f.section is not None]
    return "\n".join(out).rstrip() + "\n"


def _class_table(cls: type, fields: list[Field], lead: str, flags: dict[str, list[str]]) -> list[str]:
    out = [f"## {cls.__name__}", ""]
    text = " ".join(t for t in (lead, _summary(cls)) if t)
    if text:
        out += [text, ""]
    plain = [f for f in fields if f.section is None]
    sections = [f for f in fields if f.section is not None]
    if sections:
        out += ["Sections: " + ", ".join(f"`{f.name}:` ([{f.section.__name__}](#{_anchor(f.section)}))"
                                        for f in sections) + ".", ""]
    if plain:
        out += ["| field | type | default | meaning |", "|---|---|---|---|"]
        out += [f"| `{f.name}` | `{_cell(f.type)}` | `{_cell(f.default)}` | {_cell(f.doc)} |" for f in plain]
        out.append("")
    if flags:
        rows = sorted(flags.items(), key=lambda kv: kv[1][0])
        out += ["Flags (each sets one field):", "", "| flag | field |", "|---|---|"]
        out += [f"| {', '.join(f'`{o}`' for o in opts)} | `{key}` |" for key, opts in rows]
        out.append("")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is stale")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
        if current != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python docs/generate_configuration.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
