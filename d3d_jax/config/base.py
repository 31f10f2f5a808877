"""Config core: ConfigError, the loader (YAML files, then flags, then ``key=value`` overrides,
merged and built into a dataclass), declared bounds and type conversion.  Reading one YAML file
or value safely is :mod:`~d3d_jax.config.yaml_files`."""

from __future__ import annotations

import dataclasses
import functools
import os
import types
import typing
from typing import Any, Mapping, Sequence

# reading YAML is a module of its own; CONFIG_DIR, read_yaml and parse_scalar are re-exported here
from d3d_jax.config.yaml_files import CONFIG_DIR, _deep_merge, parse_scalar, read_yaml  # noqa: F401
from d3d_jax.errors import ConfigError, short_value  # noqa: F401 - ConfigError defined there, re-exported here

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


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _check_bound(value: Any, bound: Bound, key: str) -> None:
    if bound.checked:
        return
    if bound.text:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {short_value(value)}")
        if len(value) > bound.max_len:
            raise ConfigError(f"{key}: at most {bound.max_len} characters, got {len(value)}")
        return
    if bound.choices:
        if value not in bound.choices:
            raise ConfigError(f"{key}: must be one of {'|'.join(map(str, bound.choices))}, got {short_value(value)}")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}: expected a number, got {short_value(value)}")
    if isinstance(value, float) and value != value or value in (float("inf"), float("-inf")):
        raise ConfigError(f"{key}: must be finite, got {value}")
    if bound.lo is not None and (value <= bound.lo if bound.lo_open else value < bound.lo):
        raise ConfigError(f"{key}: must be {'>' if bound.lo_open else '>='} {_num(bound.lo)}, got {short_value(value)}")
    if bound.hi is not None and value > bound.hi:
        raise ConfigError(f"{key}: must be <= {_num(bound.hi)}, got {short_value(value)}")


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
                raise ConfigError(f"{key}: expected a boolean, got {short_value(value)}")
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
            raise ConfigError(f"{key}: expected a mapping for section {tp.__name__}, got {short_value(value)}")
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
    raise ConfigError(f"{key}: cannot interpret {short_value(value)} as {tp}")


def _convert_sequence(value: Any, tp: Any, key: str) -> Any:
    """A list or tuple (a comma-separated string from the command line), element by element."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if isinstance(value, str):
        value = [v for v in value.split(",") if v != ""]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key}: expected a list, got {short_value(value)}")
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
    raise ConfigError(f"{key}: expected a boolean, got {short_value(value)}")


def _to_int(value: Any, key: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected an integer, got {short_value(value)}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise ConfigError(f"{key}: expected an integer, got {short_value(value)}")


def _to_float(value: Any, key: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a number, got {short_value(value)}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected a number, got {short_value(value)}") from None


def _to_str(value: Any, key: str) -> str:
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{key}: expected a string, got {short_value(value)}")


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


