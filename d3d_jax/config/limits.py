"""What the program can do, as numbers: every size, count, seed and port a user gives is checked
against these at the door (the config validators, the command lines), in one line naming it.

Why each bound is where it is:

* ``MAX_BLOCK_SIZE`` — B tokens are verified per round and the drafter fills B - 1 slots in one
  forward; past 256 a round costs more than its drafts can ever return (τ <= B), and the cache
  grows by B per row.  ``--block-size 10000`` ran for minutes without an answer.
* ``MAX_CACHE_LEN`` — KV slots per row (prompt + max_new_tokens + B): 2^20, beyond every released
  Qwen3 context (128k with YaRN), so a typo is refused instead of allocating terabytes.
* ``MAX_SLOTS`` — rows decoded together.
* ``INT32_MAX`` — seeds, indices and top-k travel to the device as int32.
* ``MAX_NUMBER_CHARS`` — a number written in JSON (request bodies, ``config.json``, records) or
  YAML (configs, ``key=value``) is read only up to this many characters (sign, digits, point,
  exponent); a longer one is never converted.  Python converts an integer string in time
  quadratic in its length and refuses past 4,300 digits with a ``ValueError`` that used to end
  as an HTTP 500.  100 characters hold any 64-bit integer and any float's shortest form with
  room to spare; the magnitude that follows (|n| < 10^100, floats past 1.8e308 become inf, which
  every number field refuses as not finite) is then checked by each field's own range.
"""

from __future__ import annotations

import json
import math
import numbers
from typing import Any

from d3d_jax.errors import ConfigError

INT32_MAX = 2 ** 31 - 1
MAX_BLOCK_SIZE = 256
MAX_CACHE_LEN = 1 << 20
MAX_STOP_IDS = 16  # EOS + stop ids per request (the decoder pads them to this with -1)
MAX_SLOTS = 1 << 16  # decoder rows; statistical tests decode 20000 rows of one prompt at once
PORTS = (0, 65535)
MAX_NUMBER_CHARS = 100


class LongNumber:
    """A number literal longer than ``MAX_NUMBER_CHARS``, left unconverted where a parser met it,
    so the reader that finds it (:func:`long_number`) can name the field it sits in."""

    __slots__ = ("length",)

    def __init__(self, text: str):
        self.length = len(text)

    def __repr__(self) -> str:
        return f"a number of {self.length} characters"

    def problem(self) -> str:
        return f"a number of {self.length:,} characters; numbers are read up to {MAX_NUMBER_CHARS} characters"


def bounded_number(convert):
    """``convert`` (``int`` or ``float``) for literals up to ``MAX_NUMBER_CHARS``; a
    :class:`LongNumber` for longer ones."""
    return lambda text: LongNumber(text) if len(text) > MAX_NUMBER_CHARS else convert(text)


_PARSE_INT, _PARSE_FLOAT = bounded_number(int), bounded_number(float)


def json_loads(raw: str | bytes) -> Any:
    """``json.loads`` whose numbers are bounded before they are converted (:class:`LongNumber`
    stands for a longer one: check the result with :func:`long_number`)."""
    return json.loads(raw, parse_int=_PARSE_INT, parse_float=_PARSE_FLOAT)


def long_number(tree: Any) -> tuple[tuple, LongNumber] | None:
    """``(path, number)`` of the first :class:`LongNumber` in a parsed tree (walked without
    recursion: a tree may be deep; each shared container once: YAML aliases make a few lines
    a tree of billions of paths), or None."""
    stack, seen = [((), tree)], set()
    while stack:
        path, v = stack.pop()
        if isinstance(v, LongNumber):
            return path, v
        if isinstance(v, (dict, list)):
            if id(v) in seen:
                continue
            seen.add(id(v))
        if isinstance(v, dict):
            stack.extend((path + (k,), x) for k, x in reversed(list(v.items())))
        elif isinstance(v, list):
            stack.extend((path + (i,), x) for i, x in reversed(list(enumerate(v))))
    return None


def dotted(path: tuple) -> str:
    """``a.b[3]`` from a path of keys and indices."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def require_int(value: Any, key: str, lo: int, hi: int, why: str = "") -> int:
    """``value`` as an int in ``[lo, hi]``, or one :class:`ConfigError` naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(f"{key}: must be in [{lo}, {hi}]{why}, got {value}")
    return int(value)


def require_number(value: Any, key: str, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    if value > hi or value < lo or (lo_open and value == lo):
        raise ConfigError(f"{key}: must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value}")
    return value


def flag_or_key(prefix: str, field: str) -> str:
    """``--top-k`` for a command line (``prefix="--"``), ``regenerate.top_k`` for a config."""
    return f"--{field.replace('_', '-')}" if prefix == "--" else f"{prefix}{field}"


def check_sampling(prefix: str, *, temperature: Any = 0.0, top_p: Any = 1.0, top_k: Any = 0, seed: Any = 0,
                   max_new_tokens: Any = 1) -> None:
    """The sampling numbers of a command line (``prefix="--"``) or a config section (``"regenerate."``)."""
    name = lambda field: flag_or_key(prefix, field)  # noqa: E731
    require_number(temperature, name("temperature"), 0.0, 1e6)
    require_number(top_p, name("top_p"), 0.0, 1.0, lo_open=True)
    require_int(top_k, name("top_k"), 0, INT32_MAX, " (0 = off)")
    require_int(seed, name("seed"), 0, INT32_MAX)
    require_int(max_new_tokens, name("max_new_tokens"), 1, MAX_CACHE_LEN)
