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
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from d3d_jax.config.base import ConfigError

INT32_MAX = 2 ** 31 - 1
MAX_BLOCK_SIZE = 256
MAX_CACHE_LEN = 1 << 20
MAX_SLOTS = 1 << 16  # decoder rows; statistical tests decode 20000 rows of one prompt at once
PORTS = (0, 65535)


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
