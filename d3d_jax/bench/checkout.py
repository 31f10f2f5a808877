"""Another checkout's ``d3d_jax`` package in this process, under another top-level name.

``import_checkout(DIR)`` returns DIR's ``d3d_jax`` imported as ``d3d_jax_base``: a meta-path
finder maps ``d3d_jax_base.*`` onto DIR's source files and compiles each with its absolute
``d3d_jax`` names rewritten to the alias, so that package runs its own code end to end (its
modules import one another, never this checkout's).  Modules keep their real ``__file__``, so
paths relative to the checkout (``configs/``) resolve in DIR; nothing is written there (no
bytecode cache: the rewritten code must not land in DIR's ``__pycache__``).

What stays shared is process-wide state: jax's config and its device, which both packages only
read here.  Their pytree classes, flax modules and jit caches are distinct classes, so they do
not collide.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
from pathlib import Path

from d3d_jax.errors import UsageError

ALIAS = "d3d_jax_base"
_NAME = re.compile(r"\bd3d_jax\b")


def checkout_root(path: str | Path) -> Path:
    """DIR resolved, or one clear error when it holds no ``d3d_jax`` package."""
    root = Path(path).expanduser().resolve()
    if not (root / "d3d_jax" / "__init__.py").is_file():
        raise UsageError(f"--compare-with: {path} is not a checkout of this project "
                         f"(no d3d_jax/__init__.py in {root})")
    return root


class _Loader(importlib.machinery.SourceFileLoader):
    def get_code(self, fullname):
        source = self.get_data(self.path).decode("utf-8")
        return compile(_NAME.sub(ALIAS, source), self.path, "exec", dont_inherit=True)

    def set_data(self, *args, **kwargs):  # never cache the rewritten code in the other checkout
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        if fullname != ALIAS and not fullname.startswith(ALIAS + "."):
            return None
        base = self.root.joinpath("d3d_jax", *fullname.split(".")[1:])
        if (base / "__init__.py").is_file():
            init = str(base / "__init__.py")
            return importlib.util.spec_from_file_location(
                fullname, init, loader=_Loader(fullname, init), submodule_search_locations=[str(base)])
        module = base.with_suffix(".py")
        if module.is_file():
            return importlib.util.spec_from_file_location(fullname, str(module),
                                                          loader=_Loader(fullname, str(module)))
        if base.is_dir():  # a namespace package (a folder without __init__.py)
            spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = [str(base)]
            return spec
        return None


def import_checkout(path: str | Path):
    """The ``d3d_jax`` package of the checkout at ``path``, imported as :data:`ALIAS`.  Pointing
    the alias at another checkout drops the modules imported from the previous one."""
    root = checkout_root(path)
    finders = [f for f in sys.meta_path if isinstance(f, _Finder)]
    if finders and finders[0].root != root:
        for f in finders:
            sys.meta_path.remove(f)
        for name in [n for n in sys.modules if n == ALIAS or n.startswith(ALIAS + ".")]:
            del sys.modules[name]
        finders = []
    if not finders:
        sys.meta_path.insert(0, _Finder(root))
    importlib.invalidate_caches()
    return importlib.import_module(ALIAS)


def submodule(package, name: str):
    """``package.name`` (dotted) imported from the aliased checkout, e.g. ``"decoding.engine"``."""
    return importlib.import_module(f"{package.__name__}.{name}")
