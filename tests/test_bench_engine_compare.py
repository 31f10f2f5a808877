"""``infer/bench.py engine --compare-with``: another checkout's package imported in this process
under an alias, running its own code, timed beside this checkout's."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import pytest

from d3d_jax.bench import checkout
from d3d_jax.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--layers", "1", "--hidden", "64", "--intermediate", "128", "--heads", "2", "--kv-heads", "1",
        "--head-dim", "32", "--vocab", "256", "--prompt-len", "8", "--max-new-tokens", "8",
        "--block-size", "4", "--repeats", "2", "--skip-transformers"]


def _fake_checkout(root: Path, value: str) -> Path:
    pkg = root / "d3d_jax"
    (pkg / "sub").mkdir(parents=True)
    (root / "configs").mkdir()
    (root / "configs" / "x.txt").write_text(value)
    (pkg / "__init__.py").write_text("from d3d_jax.sub.leaf import VALUE, CONFIG\nimport d3d_jax.sub as SUB\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "leaf.py").write_text(
        "from pathlib import Path\nVALUE = 'd3d_jax:' + __name__\n"
        "CONFIG = (Path(__file__).resolve().parents[2] / 'configs' / 'x.txt').read_text()\n")
    return root


def test_an_aliased_checkout_imports_its_own_modules_and_files(tmp_path):
    """Absolute imports inside the other tree resolve to that tree (names rewritten), paths
    relative to its files resolve there, and nothing is cached into it."""
    import d3d_jax

    one = checkout.import_checkout(_fake_checkout(tmp_path / "one", "first"))
    assert one.VALUE == "d3d_jax_base:d3d_jax_base.sub.leaf"  # its own names, rewritten
    assert one.CONFIG == "first" and one.SUB is sys.modules["d3d_jax_base.sub"]
    assert sys.modules["d3d_jax"] is d3d_jax and not hasattr(d3d_jax, "VALUE")  # ours untouched
    two = checkout.import_checkout(_fake_checkout(tmp_path / "two", "second"))  # re-pointed
    assert two.CONFIG == "second" and two is not one
    assert not list(tmp_path.rglob("*.pyc"))


def _args(*extra):
    from d3d_jax.bench import engine as bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return bench, p.parse_args(TINY + list(extra))


def test_compare_with_a_path_that_is_not_a_checkout_is_one_clear_error(tmp_path):
    bench, args = _args("--compare-with", str(tmp_path))
    with pytest.raises(UsageError, match="is not a checkout of this project"):
        bench.run(args)


def test_compare_with_a_copy_of_this_checkout_makes_the_same_tokens_at_the_same_speed(tmp_path):
    """The copy runs its own engine (its modules' files are the copy's); both sides make the
    same tokens, and their per-repeat ratios sit near 1."""
    shutil.copytree(ROOT / "d3d_jax", tmp_path / "d3d_jax", ignore=shutil.ignore_patterns("__pycache__"))
    bench, args = _args("--compare-with", str(tmp_path))
    res = bench.run(args)
    c = res["compare"]
    assert Path(sys.modules["d3d_jax_base.decoding.engine"].__file__).is_relative_to(tmp_path)
    for m in ("plain", "sync"):
        assert c[m]["same_tokens"] is True
        assert c[m]["ratio"]["repeats"] == 2
        # same code: near 1 (loose: a shared CPU moves single runs by tens of percent)
        assert 0.4 < c[m]["ratio"]["median"] < 2.5 and 0.4 < c[m]["ratio"]["of_minima"] < 2.5
    assert res["sync_efficiency"]["same_tokens_as_plain"] is True
    assert "(c) sync: identical tokens" in bench.format_table(res)
    assert not list(tmp_path.rglob("*.pyc"))


def test_the_median_interval_takes_the_order_statistics_of_the_binomial_table():
    from d3d_jax.bench.engine_compare import median_interval

    # 95 %: the 6th and 15th of 20 sorted samples, the 40th and 61st of 100 (1-based)
    assert median_interval([float(x) for x in range(20, 0, -1)]) == (6.0, 15.0)
    assert median_interval([float(x) for x in range(1, 101)]) == (40.0, 61.0)
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)  # too few for 95 %: the full range
