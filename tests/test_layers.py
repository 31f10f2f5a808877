"""Layers point one way: the import graph of ``d3d_jax`` (and the ``infer/`` programs that decode),
read from the source with ``ast`` — every import counts, those inside functions too, since a
lazy import is still a dependency (the evaluation circle was two lazy imports).  Imports under
``if TYPE_CHECKING:`` are annotations only and are left out."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Serving and the decoding command line stand on io/, model/, decoding/ and config/, never on
# training/ (prompt formats, chat templates and input checks live in io/).
NO_TRAINING = ("d3d_jax.serving", "infer.generate", "infer.serve")


def _module_names() -> dict[str, Path]:
    names = {}
    for path in sorted((ROOT / "d3d_jax").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for name in ("generate", "serve"):
        names[f"infer.{name}"] = ROOT / "infer" / f"{name}.py"
    return names


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The ``d3d_jax`` modules ``name`` imports (a package's ``__init__`` when no module matches)."""
    def resolve(target: str) -> str | None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _type_checking_nodes(tree)
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(resolve(a.name) for a in node.names if a.name.startswith("d3d_jax"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.startswith("d3d_jax"):
                # ``from pkg import mod`` imports the module; ``from mod import name`` the module.
                found.update(resolve(f"{base}.{a.name}") if f"{base}.{a.name}" in known else resolve(base)
                             for a in node.names)
    found.discard(None)
    found.discard(name)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = _module_names()
    return {name: _imports(name, path, known) for name, path in known.items()}


def _reachable(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module ``start`` reaches, mapped to the module that imports it on one path there."""
    seen, todo = {}, [start]
    while todo:
        here = todo.pop()
        for dep in graph.get(here, ()):
            if dep not in seen and dep != start:
                seen[dep] = here
                todo.append(dep)
    return seen


def _path(via: dict[str, str], start: str, end: str) -> list[str]:
    chain = [end]
    while chain[-1] != start:
        chain.append(via[chain[-1]])
    return chain[::-1]


def test_serving_and_generate_never_reach_training(graph):
    bad = []
    for name in sorted(graph):
        if name.startswith(NO_TRAINING):
            via = _reachable(graph, name)
            bad += [" -> ".join(_path(via, name, dep)) for dep in sorted(via) if dep.startswith("d3d_jax.training")]
    assert not bad, "serving/generate import training/:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every import cycle once, written from its smallest module: ``a -> b -> a``."""
    cycles = set()
    for name in graph:
        for dep in graph[name]:
            back = _reachable(graph, dep)
            if name == dep or name in back:
                cycle = [name] + (_path(back, dep, name) if name != dep else [name])
                if min(cycle[:-1]) == name:
                    cycles.add(" -> ".join(cycle))
    return sorted(cycles)


def test_no_import_cycle(graph):
    cycles = _cycles(graph)
    assert not cycles, "import cycles among d3d_jax modules:\n" + "\n".join(cycles)


def test_the_walker_sees_lazy_and_relative_imports(tmp_path):
    """The checks above can fail: a function-level import and a relative import are both edges,
    a TYPE_CHECKING import is not."""
    src = tmp_path / "d3d_jax" / "a"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("")
    (src / "x.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from d3d_jax.a import z\n"
                              "def f():\n    from . import y\n")
    (src / "y.py").write_text("from d3d_jax.a.x import f\n")
    (src / "z.py").write_text("")
    known = {"d3d_jax.a": src / "__init__.py", "d3d_jax.a.x": src / "x.py", "d3d_jax.a.y": src / "y.py",
             "d3d_jax.a.z": src / "z.py"}
    assert _imports("d3d_jax.a.x", known["d3d_jax.a.x"], known) == {"d3d_jax.a.y"}
    assert _imports("d3d_jax.a.y", known["d3d_jax.a.y"], known) == {"d3d_jax.a.x"}
    graph = {n: _imports(n, p, known) for n, p in known.items()}
    assert _cycles(graph) == ["d3d_jax.a.x -> d3d_jax.a.y -> d3d_jax.a.x"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


# --------------------------------------------------------------------------------------------
# docs/architecture.md's module map names every module, and every name it holds exists
# --------------------------------------------------------------------------------------------
def _expand(token: str) -> list[str]:
    """``a/{b,c}.py`` -> ``a/b.py``, ``a/c.py``."""
    head, brace, rest = token.partition("{")
    if not brace:
        return [token]
    inner, _, tail = rest.partition("}")
    return [p for part in inner.split(",") for p in _expand(head + part + tail)]


def layout_paths(readme: str) -> set[str]:
    """Paths the first column of the module map's tables names (the first ``## `` section).  In a cell, ``dir/`` followed
    by bare names (``protocol``, ``cli.py``) names ``dir/protocol.py`` …; a path that does not
    start at the repository root is under ``d3d_jax/``."""
    import re

    section = readme.split("\n## ", 2)[1]  # the first section, which holds both tables
    out = set()
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cell = re.split(r"(?<!\\)\|", line)[1]
        here = None
        for token in re.findall(r"`([^`]+)`", cell):
            if "/" not in token and here is not None:
                out.add(here + (token if "." in token else token + ".py"))
                continue
            for path in _expand(token):
                if not (ROOT / path.split("/")[0]).exists():
                    path = "d3d_jax/" + path
                out.add(path)
                here = path if path.endswith("/") else here
    return out


ARCHITECTURE = ROOT / "docs" / "architecture.md"


def test_module_map_matches_the_tree():
    named = layout_paths(ARCHITECTURE.read_text(encoding="utf-8"))
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md's module map names paths that do not exist: {missing}"
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "d3d_jax").rglob("*.py") if p.name != "__init__.py"}
    unnamed = sorted(m for m in modules if m not in named)
    assert not unnamed, f"modules docs/architecture.md's module map does not name: {unnamed}"


def test_concept_index_names_existing_paths():
    """The paper concept -> module table points at files and folders that exist."""
    import re

    text = ARCHITECTURE.read_text(encoding="utf-8")
    section = text.split("\n## Paper concept", 1)[1].split("\n## ", 1)[0]
    paths = {t for line in section.splitlines() if line.startswith("| ")
             for t in re.findall(r"`([\w./-]+/[\w./-]*)`", line)}
    assert len(paths) >= 15, paths
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md's concept index names paths that do not exist: {missing}"


def test_layout_reader_expands_braces_and_directory_names():
    text = ("# T\n\n## Overview\n\n| path | what |\n|---|---|\n"
            "| `d3d_jax/io/{hf,records}.py`, `configs/serve/` | x |\n"
            "| `d3d_jax/serving/` (`app`, `server.py`), `bench/x.py` | y \\| z |\n## Next\n")
    assert layout_paths(text) == {"d3d_jax/io/hf.py", "d3d_jax/io/records.py", "configs/serve/",
                                  "d3d_jax/serving/", "d3d_jax/serving/app.py", "d3d_jax/serving/server.py",
                                  "d3d_jax/bench/x.py"}
