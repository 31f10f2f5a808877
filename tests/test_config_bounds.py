"""Every config field's declared range (``BOUNDS`` on each dataclass, d3d_jax/config/base.py's
:func:`check_fields`): declared for every field, and met by YAML, ``key=value`` overrides, flags
and a Hugging Face ``config.json`` alike."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import pkgutil
import typing

import pytest

import d3d_jax.config as C
from d3d_jax.config.base import Bound, ConfigError, load_config, undeclared_fields


def config_classes() -> list[type]:
    out = []
    for m in pkgutil.iter_modules(C.__path__):
        mod = importlib.import_module(f"d3d_jax.config.{m.name}")
        out += [o for o in vars(mod).values() if isinstance(o, type) and dataclasses.is_dataclass(o)
                and o.__module__ == mod.__name__ and o is not Bound]
    return out


def test_every_config_field_declares_its_range():
    """A field added without a declared range or choice set fails here (booleans and sections
    are declared by their type)."""
    classes = config_classes()
    assert len(classes) >= 20, classes
    missing = {c.__name__: undeclared_fields(c) for c in classes if undeclared_fields(c)}
    assert not missing, f"fields without a declared range (add them to the class's BOUNDS): {missing}"
    for c in classes:
        extra = set(getattr(c, "BOUNDS", {})) - {f.name for f in dataclasses.fields(c)}
        assert not extra, (c.__name__, extra)


# top-level configs and what each needs to load at all
TOP = [(C.TrainRunConfig, []), (C.ServeConfig, ["models.target=t"]), (C.GenerateConfig, ["models.target=t"]),
       (C.EvalConfig, ["models.target=t", "models.drafter=d"]), (C.PruneRunConfig, ["prune.drafter=d", "data.train_path=x", "data.dev_path=y"]),
       (C.PipelineConfig, []), (C.RegenerateConfig, [])]


def _bad_values(bound: Bound, hint) -> list[str]:
    """YAML texts outside ``bound``: just past each end, and a non-finite number."""
    if bound.checked:
        return []
    if bound.text:
        return ["x" * (bound.max_len + 1)]
    if bound.choices:
        return ["no_such_choice"]
    integral = all(isinstance(v, int) for v in (bound.lo, bound.hi) if v is not None) and float not in _leaves(hint)
    out = []
    if bound.lo is not None:
        lo = bound.lo if bound.lo_open else bound.lo - (1 if integral else 1e-3 * max(1, abs(bound.lo)))
        out.append(repr(lo))
    if bound.hi is not None and math.isfinite(bound.hi):
        out.append(repr(bound.hi + 1 if integral else bound.hi * 2 + 1))
    if not integral:
        out += [".inf", ".nan"]
    return out


def _leaves(tp) -> set:
    args = typing.get_args(tp)
    return {tp} if not args else set().union(*(_leaves(a) for a in args if a is not Ellipsis))


def _nest(text: str, hint) -> str:
    """The value in the shape of a tuple field (``[v]``, ``[[v, v]]``)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    tp = args[0] if len(args) == 1 and typing.get_origin(hint) in (typing.Union, type(None).__class__) else hint
    if typing.get_origin(hint) is typing.Union or str(type(hint)) == "<class 'types.UnionType'>":
        tp = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(tp) is tuple:
        inner = typing.get_args(tp)[0]
        return f"[{_nest(text, inner)}, {_nest(text, inner)}]" if typing.get_origin(inner) is tuple else f"[{text}]"
    return text


def _fields(cls, prefix=""):
    """(dotted key, bound, type) of every declared field of ``cls`` and its sections."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            if hints[f.name] is not C.ModelConfig or cls is not C.PipelineConfig:
                yield from _fields(hints[f.name], key + ".")
        elif f.name in getattr(cls, "BOUNDS", {}):
            yield key, cls.BOUNDS[f.name], hints[f.name]


@pytest.mark.parametrize("cls, base", TOP, ids=[c.__name__ for c, _ in TOP])
def test_every_value_outside_its_declared_range_is_refused_naming_the_key(cls, base):
    load_config(cls, [], base)  # the base loads
    n = 0
    for key, bound, hint in _fields(cls):
        for text in _bad_values(bound, hint):
            with pytest.raises(ConfigError) as e:
                load_config(cls, [], base + [f"{key}={_nest(text, hint)}"])
            msg = str(e.value)
            assert f"{key.split('.')[-1]}" in msg.split(":")[0] or key.split(".")[-1] in msg, (key, text, msg)
            assert len(msg) < 300 and "\n" not in msg, msg
            n += 1
    assert n >= 10, n


def test_the_silent_config_cases_are_refused():
    """Two configs that were accepted silently: ``optim.learning_rate: .inf`` (the run failed later, blaming a record) and
    ``--max-queue 0`` (every request a 503) are refused at load."""
    with pytest.raises(ConfigError, match=r"optim.learning_rate: must be finite"):
        load_config(C.TrainRunConfig, [], ["optim.learning_rate=.inf"])
    with pytest.raises(ConfigError, match=r"server.max_queue: must be >= 1, got 0"):
        load_config(C.ServeConfig, [], ["models.target=t", "server.max_queue=0"])


def test_flags_read_the_same_declaration(capsys):
    from d3d_jax.serving.server import add_arguments

    parser = add_arguments(argparse.ArgumentParser(prog="serve.py"))
    for flag, value in (("--max-queue", "0"), ("--port", "-1"), ("--num-slots", "0"), ("--block-size", "1")):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["--target", "t", flag, value])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and flag in err[-1] and f"got {value}" in err[-1], err


HF = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}


@pytest.mark.parametrize("changes, key", [
    ({"rope_theta": -1.0}, "rope_theta"), ({"rope_theta": 1e300}, "rope_theta"), ({"head_dim": 0}, "head_dim"),
    ({"vocab_size": 10 ** 12}, "vocab_size"), ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ({"max_position_embeddings": 0}, "max_position_embeddings"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "beta_fast": 32.0,
                          "beta_slow": -1.0, "original_max_position_embeddings": 16}}, "beta_slow")])
def test_config_json_values_meet_the_declared_ranges(tmp_path, changes, key):
    from d3d_jax.config.model import load_model_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF | changes))
    with pytest.raises(ConfigError, match=key):
        load_model_config(path)
