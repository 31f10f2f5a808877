"""Reading YAML safely: a config file (``include:`` resolved, relative to the file or
``configs/``) or one ``key=value`` right-hand side, with every size bounded before it is
expanded or converted: the file's bytes, its values once aliases are expanded, include depth,
and each number's length (:mod:`~d3d_jax.config.limits`).  A key given twice is refused.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import yaml

from d3d_jax.config.limits import MAX_NUMBER_CHARS, LongNumber, dotted, long_number
from d3d_jax.errors import ConfigError, short_value

CONFIG_DIR = Path(__file__).resolve().parent.parent.parent / "configs"

MAX_YAML_VALUES = 1_000_000  # scalars + containers of a config once its aliases are expanded
MAX_YAML_BYTES = 16 << 20  # a config file; the repository's largest is a few KB
MAX_INCLUDE_DEPTH = 16


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader whose numbers longer than ``MAX_NUMBER_CHARS`` are never converted
    (:class:`~d3d_jax.config.limits.LongNumber`; :func:`_check_numbers` names their key)."""


for _tag, _convert_number in (("int", yaml.SafeLoader.construct_yaml_int),
                              ("float", yaml.SafeLoader.construct_yaml_float)):
    def _bounded(loader, node, _convert=_convert_number):
        return LongNumber(node.value) if len(node.value) > MAX_NUMBER_CHARS else _convert(loader, node)
    _BoundedLoader.add_constructor(f"tag:yaml.org,2002:{_tag}", _bounded)


def _check_numbers(data: Any, file: str = "", key: str = "") -> None:
    """A :class:`ConfigError` naming the key of the first number too long to convert."""
    found = long_number(data)
    if found is not None:
        name = dotted(((key,) if key else ()) + found[0]) or "the value"
        raise ConfigError(f"{file + ': ' if file else ''}{name}: {found[1].problem()}")


def parse_scalar(text: str, key: str) -> Any:
    """Parse the right-hand side of ``key=value`` with YAML rules (numbers, bools, lists), its
    numbers bounded before they are converted (``ConfigError`` naming ``key`` otherwise)."""
    try:
        value = yaml.load(text, Loader=_BoundedLoader)
    except yaml.YAMLError:
        return text
    _check_size(value, key)  # first: the walks below would expand an alias bomb
    _check_numbers(value, key=key)
    return value


class _UniqueKeyLoader(_BoundedLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (a section written twice
    kept only its last copy, silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *base' merges, by design
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: PyYAML's own error says so
                break
            if first != key_node.start_mark.line + 1:
                raise ConfigError(f"{short_value(key)} is given twice (lines {first} and {key_node.start_mark.line + 1}); "
                                  "keep one")
        return super().construct_mapping(node, deep=deep)


def _expanded_size(data: Any, limit: int) -> int:
    """How many values ``data`` holds with every shared (aliased) part counted each time it
    appears, stopping past ``limit``: a few lines of YAML aliases can stand for billions."""
    sizes: dict[int, int] = {}

    def size(x: Any) -> int:
        if not isinstance(x, (dict, list)):
            return 1
        if id(x) in sizes:
            return sizes[id(x)]
        sizes[id(x)] = limit + 1  # a cycle (a recursive alias) is refused too
        children = x.values() if isinstance(x, dict) else x
        total = 1
        for c in children:
            total += size(c)
            if total > limit:
                break
        sizes[id(x)] = min(total, limit + 1)
        return sizes[id(x)]
    return size(data)


def _check_size(data: Any, where: str) -> None:
    try:
        too_big = _expanded_size(data, MAX_YAML_VALUES) > MAX_YAML_VALUES
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply") from None
    if too_big:
        raise ConfigError(f"{where}: expands to more than {MAX_YAML_VALUES:,} values (YAML aliases "
                          "repeated inside each other?); a config is far smaller")


def read_yaml(path: str | os.PathLike, _chain: tuple = ()) -> dict:
    """Read a YAML config, resolving ``include:`` (paths relative to the file or configs/)."""
    path = Path(path)
    if not path.exists() and (CONFIG_DIR / path).exists():
        path = CONFIG_DIR / path
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    real = path.resolve()
    if real in _chain:
        names = " -> ".join(str(p) for p in _chain[_chain.index(real):] + (real,))
        raise ConfigError(f"{path}: include: makes a cycle ({names})")
    if len(_chain) >= MAX_INCLUDE_DEPTH:
        raise ConfigError(f"{path}: includes nest deeper than {MAX_INCLUDE_DEPTH} files")
    if path.is_file() and path.stat().st_size > MAX_YAML_BYTES:
        raise ConfigError(f"{path}: {path.stat().st_size:,} bytes; a config file is at most {MAX_YAML_BYTES:,}")
    from d3d_jax.io.files import open_regular  # io/ stands on config/: imported here, not at the top

    with open_regular(path, "a config file", ConfigError) as f:
        try:
            data = yaml.load(f, Loader=_UniqueKeyLoader) or {}
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        except RecursionError:
            raise ConfigError(f"{path}: nested too deeply") from None
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{path}: not valid YAML{where} ({getattr(e, 'problem', None) or e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    _check_size(data, str(path))
    _check_numbers(data, file=str(path))
    includes = data.pop("include", []) or []
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise ConfigError(f"{path}: include: must be a file name or a list of them, got {short_value(includes)}")
    merged: dict = {}
    for inc in includes:
        inc_path = path.parent / inc
        if not inc_path.exists():
            inc_path = CONFIG_DIR / inc
        merged = _deep_merge(merged, read_yaml(inc_path, _chain + (real,)))
    return _deep_merge(merged, data)


def _deep_merge(base: dict, extra: Mapping) -> dict:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out
