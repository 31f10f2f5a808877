"""Config core: ConfigError, the YAML + ``key=value`` loader and type conversion."""

from __future__ import annotations

import dataclasses
import functools
import os
import types
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from d3d_jax.config.limits import MAX_NUMBER_CHARS, LongNumber, dotted, long_number
from d3d_jax.errors import ConfigError  # noqa: F401 - defined there, re-exported here

CONFIG_DIR = Path(__file__).resolve().parent.parent.parent / "configs"

DTYPES = ("float32", "bfloat16", "float16")


_MISSING = object()
# ModelConfig field -> HF config.json key, where they differ
_HF_KEY_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                 "num_kv_heads": "num_key_value_heads"}


def _require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")



# --------------------------------------------------------------------------------------
# Declared ranges: each config dataclass's BOUNDS, read by one checker for every loader
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Bound:
    """The values a field may hold (each element, for a tuple field); ``None`` passes when the
    field's type allows it.  Numbers: finite, in ``[lo, hi]`` (``lo_open``: ``(lo, hi]``).
    ``choices``: one of them.  ``text``: a string of at most ``max_len`` characters.
    ``checked``: a structured value whose ``validate()`` checks it (``why`` says where)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    choices: tuple = ()
    text: bool = False
    max_len: int = 4096
    checked: str = ""


def between(lo: float, hi: float) -> Bound:
    return Bound(lo=lo, hi=hi)


def above(lo: float, hi: float) -> Bound:
    """``(lo, hi]``: a scale, rate or length that must be positive."""
    return Bound(lo=lo, hi=hi, lo_open=True)


def one_of(*choices: Any) -> Bound:
    return Bound(choices=tuple(choices))


TEXT = Bound(text=True)  # a path, name or free text


def checked(where: str) -> Bound:
    return Bound(checked=where)


def _short(value: Any) -> str:
    """A value for an error message, cut short (a YAML alias can expand to gigabytes)."""
    if isinstance(value, (str, bytes)):
        text = repr(value[:60])
        return text if len(value) <= 60 else f"{text[:-1]}...' ({len(value)} characters)"
    if isinstance(value, (list, tuple, dict, set)):
        return f"a {type(value).__name__} of {len(value)} items"
    text = repr(value)
    return text if len(text) <= 60 else text[:40] + f"... ({len(text)} characters)"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _check_bound(value: Any, bound: Bound, key: str) -> None:
    if bound.checked:
        return
    if bound.text:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {_short(value)}")
        if len(value) > bound.max_len:
            raise ConfigError(f"{key}: at most {bound.max_len} characters, got {len(value)}")
        return
    if bound.choices:
        if value not in bound.choices:
            raise ConfigError(f"{key}: must be one of {'|'.join(map(str, bound.choices))}, got {_short(value)}")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}: expected a number, got {_short(value)}")
    if isinstance(value, float) and value != value or value in (float("inf"), float("-inf")):
        raise ConfigError(f"{key}: must be finite, got {value}")
    if bound.lo is not None and (value <= bound.lo if bound.lo_open else value < bound.lo):
        raise ConfigError(f"{key}: must be {'>' if bound.lo_open else '>='} {_num(bound.lo)}, got {_short(value)}")
    if bound.hi is not None and value > bound.hi:
        raise ConfigError(f"{key}: must be <= {_num(bound.hi)}, got {_short(value)}")


def _elements(value: Any):
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _elements(v)
    else:
        yield value


def undeclared_fields(cls: type) -> list[str]:
    """Fields of ``cls`` with no declared bound: every field but booleans and sections needs one."""
    hints = _hints(cls)
    bounds = getattr(cls, "BOUNDS", {})
    return [f.name for f in dataclasses.fields(cls)
            if f.name not in bounds and not _is_flag(hints[f.name]) and not _is_section(hints[f.name])]


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def _is_flag(tp: Any) -> bool:
    """``bool`` or ``bool | None``: the type is the whole declaration."""
    return tp is bool or set(typing.get_args(tp)) == {bool, type(None)}


def _is_section(tp: Any) -> bool:
    args = [a for a in typing.get_args(tp) if a is not Ellipsis and a is not type(None)]
    return dataclasses.is_dataclass(tp) or bool(args) and all(dataclasses.is_dataclass(a) for a in args)


def check_fields(obj: Any, prefix: str = "") -> None:
    """Every field of config ``obj`` (and of its sections) against its declared :class:`Bound`;
    booleans against their type.  One :class:`ConfigError` naming the first key out of range."""
    bounds = getattr(type(obj), "BOUNDS", {})
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(value):
            check_fields(value, key)
            continue
        if isinstance(value, (tuple, list)) and value and all(dataclasses.is_dataclass(v) for v in value):
            for i, v in enumerate(value):
                check_fields(v, f"{key}[{i}]")
            continue
        if f.name not in bounds:
            if _is_flag(_hints(type(obj))[f.name]) and not (isinstance(value, bool) or value is None):
                raise ConfigError(f"{key}: expected a boolean, got {_short(value)}")
            continue
        for v in _elements(value):
            if v is not None:
                _check_bound(v, bounds[f.name], key)


def default_prefix(cls: type) -> str:
    """The key prefix ``cls.validate`` names its fields with (``model`` for ModelConfig)."""
    import inspect

    validate = getattr(cls, "validate", None)
    param = inspect.signature(validate).parameters.get("prefix") if validate is not None else None
    return param.default if param is not None and isinstance(param.default, str) else ""


# --------------------------------------------------------------------------------------
# Generic YAML + overrides loader
# --------------------------------------------------------------------------------------
def _convert(value: Any, tp: Any, key: str) -> Any:
    """Convert a YAML/CLI value to the declared field type, or raise ConfigError."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        return _convert_union(value, tp, key)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping for section {tp.__name__}, got {_short(value)}")
        return build_dataclass(tp, value, key)
    if origin in (tuple, list, Sequence) or tp in (tuple, list):
        return _convert_sequence(value, tp, key)
    if tp in _SCALARS:
        return _SCALARS[tp](value, key)
    return value


def _convert_union(value: Any, tp: Any, key: str) -> Any:
    """The first member type that accepts ``value`` (``none``/``null`` for an optional field)."""
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args:
        return None
    for a in args:
        if a is type(None):
            continue
        try:
            return _convert(value, a, key)
        except ConfigError:
            pass
    raise ConfigError(f"{key}: cannot interpret {_short(value)} as {tp}")


def _convert_sequence(value: Any, tp: Any, key: str) -> Any:
    """A list or tuple (a comma-separated string from the command line), element by element."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if isinstance(value, str):
        value = [v for v in value.split(",") if v != ""]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key}: expected a list, got {_short(value)}")
    if args and not (len(args) == 2 and args[1] is Ellipsis) and origin is tuple:
        if len(args) != len(value):
            raise ConfigError(f"{key}: expected {len(args)} items, got {len(value)}")
        return tuple(_convert(v, a, key) for v, a in zip(value, args))
    elem = args[0] if args else Any
    out = [_convert(v, elem, key) for v in value]
    return tuple(out) if (origin is tuple or tp is tuple) else out


def _to_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
        return True
    if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
        return False
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ConfigError(f"{key}: expected a boolean, got {_short(value)}")


def _to_int(value: Any, key: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected an integer, got {_short(value)}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise ConfigError(f"{key}: expected an integer, got {_short(value)}")


def _to_float(value: Any, key: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a number, got {_short(value)}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected a number, got {_short(value)}") from None


def _to_str(value: Any, key: str) -> str:
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{key}: expected a string, got {_short(value)}")


_SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


def build_dataclass(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    """Build (nested) dataclass ``cls`` from a mapping, converting and checking every key."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else k
        if k not in fields:
            if k in getattr(cls, "ELSEWHERE", {}):
                raise ConfigError(f"{key}: not a setting here: it is {cls.ELSEWHERE[k]}")
            raise ConfigError(f"{key}: unknown key (known: {', '.join(sorted(fields))})")
        kwargs[k] = _convert(v, hints[k], key)
    try:
        obj = cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{prefix or cls.__name__}: {e}") from None
    return obj




def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {p} is not a section")
    node[parts[-1]] = value


def _deep_merge(base: dict, extra: Mapping) -> dict:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


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
                raise ConfigError(f"{_short(key)} is given twice (lines {first} and {key_node.start_mark.line + 1}); "
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
        raise ConfigError(f"{path}: include: must be a file name or a list of them, got {_short(includes)}")
    merged: dict = {}
    for inc in includes:
        inc_path = path.parent / inc
        if not inc_path.exists():
            inc_path = CONFIG_DIR / inc
        merged = _deep_merge(merged, read_yaml(inc_path, _chain + (real,)))
    return _deep_merge(merged, data)


def parse_overrides(overrides: Sequence[str]) -> dict:
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{item}: overrides must look like key=value")
        k, v = item.split("=", 1)
        value = parse_scalar(v, k.strip()[:100])
        _set_dotted(tree, k.strip(), value)
    return tree


def _merge_layer(tree: dict, layer: Mapping, hints: dict) -> dict:
    """``layer`` (one YAML file, or the overrides) merged over ``tree``.

    A section given as a file name (``model: models/qwen3-8b.yaml``) is read here, where it
    appears: it replaces the section, and later layers' ``model.X`` keys merge into the file's
    mapping instead of replacing it (``model.attention_backend=pallas`` keeps the file's shapes).
    """
    for k, v in layer.items():
        is_file = isinstance(v, str) and v.endswith((".yaml", ".yml"))
        if is_file and k in hints and dataclasses.is_dataclass(hints[k]):
            tree = {**tree, k: read_yaml(v)}
        else:
            tree = _deep_merge(tree, {k: v})
    return tree


def load_config(cls: type, paths: Sequence[str | os.PathLike] = (), overrides: Sequence[str] = (),
                flags: Mapping[str, Any] | None = None) -> Any:
    """Load dataclass ``cls`` from YAML ``paths`` merged in order, then ``flags`` (``{dotted key:
    value}`` of command-line flags, :mod:`~d3d_jax.config.flags`), then ``key=value`` overrides.

    A ``model: path/to/model.yaml`` string value of a section is read as a YAML file too.
    Validation runs ``cls.validate()`` when it exists.
    """
    hints = typing.get_type_hints(cls)
    tree: dict = {}
    flag_tree: dict = {}
    for key, value in (flags or {}).items():
        _set_dotted(flag_tree, key, value)
    for layer in [read_yaml(p) for p in paths] + [flag_tree, parse_overrides(overrides)]:
        tree = _merge_layer(tree, layer, hints)
    cfg = build_dataclass(cls, tree)
    check_fields(cfg, default_prefix(cls))  # each field's declared range, then the combinations
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def parse_config_cli(cls: type, argv: Sequence[str] | None, description: str | None = None,
                     add_arguments: Any = None) -> tuple[Any, Any]:
    """The shared shape of our config-driven programs: ``--config A.yaml [--config B.yaml] key=value …``.

    Returns ``(config, args)``; a bad config raises :class:`ConfigError` naming the key (the
    program's :func:`d3d_jax.cli.run_cli` prints it in one line and exits with status 2).
    """
    import argparse

    ap = argparse.ArgumentParser(description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", default=[], help=f"YAML with {cls.__name__} fields")
    if add_arguments is not None:
        add_arguments(ap)
    ap.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=100")
    args = ap.parse_intermixed_args(argv)  # key=value before and after each --config
    return load_config(cls, args.config, args.overrides), args


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def replace(cfg: Any, **changes: Any) -> Any:
    """``dataclasses.replace`` that re-validates."""
    new = dataclasses.replace(cfg, **changes)
    if hasattr(new, "validate"):
        new.validate()
    check_fields(new, default_prefix(type(new)))
    return new


