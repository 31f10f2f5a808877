"""Row operations on the decoder's state (``decoding/window.py``): what they do, checked against a
NumPy replay, and what the compiled program does not do (copy the whole K/V cache per swap)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from d3d_jax.decoding import window as W
from d3d_jax.model.kv_cache import KVCache, LayerKVCache

L, B, S, K, H = 2, 8, 48, 2, 16


def _tree(seed: int = 0, layered: bool = False):
    rng = np.random.default_rng(seed)
    cache = KVCache(jnp.asarray(rng.normal(size=(L, B, S, K, H)), jnp.float32),
                    jnp.asarray(rng.normal(size=(L, B, S, K, H)), jnp.float32),
                    jnp.asarray(rng.integers(0, S, B), jnp.int32))
    if layered:  # the same values, one heads-first array per layer (the CPU layout)
        cache = LayerKVCache((), (), cache.lengths).replaced(cache.k_lbskh, cache.v_lbskh, cache.lengths)
    return {"cache": cache, "seq": jnp.asarray(rng.integers(0, 99, (B, S)), jnp.int32),
            "done": jnp.zeros((B,), bool), "step": jnp.int32(7)}


def _mark(t, row, flag):
    return dict(t, done=t["done"].at[row].set(t["done"][row] | flag))


def _replay(tree, ops):
    """The same operations on NumPy copies, one at a time."""
    k, v = np.array(tree["cache"].k_lbskh), np.array(tree["cache"].v_lbskh)
    lengths, seq, done = np.array(tree["cache"].lengths), np.array(tree["seq"]), np.array(tree["done"])
    for a, b, kind in ops:
        if kind == W.OP_FREE:
            done[a] = True
            continue
        for arr, axis in ((k, 1), (v, 1), (lengths, 0), (seq, 0), (done, 0)):
            idx = [slice(None)] * arr.ndim
            ia, ib = list(idx), list(idx)
            ia[axis], ib[axis] = a, b
            arr[tuple(ia)], arr[tuple(ib)] = arr[tuple(ib)].copy(), arr[tuple(ia)].copy()
    return k, v, lengths, seq, done


@pytest.mark.parametrize("seed,layered", [(0, False), (1, False), (0, True)])
def test_row_ops_swap_and_free_rows_in_order_like_a_numpy_replay(seed, layered):
    rng = np.random.default_rng(seed)
    ops = [(int(rng.integers(B)), int(rng.integers(B)), int(rng.integers(2))) for _ in range(12)]
    ops[3] = (5, 5, W.OP_SWAP)  # a row swapped with itself stays as it is
    tree = _tree(seed, layered)
    want = _replay(tree, ops)
    padded = np.zeros((16, 3), np.int32)
    padded[: len(ops)] = ops
    fn = jax.jit(lambda t, o, n: W.apply_row_ops(t, o, n, _mark))
    got = fn(tree, jnp.asarray(padded), len(ops))
    for g, w in zip((got["cache"].lengths, got["seq"], got["done"]), want[2:]):
        np.testing.assert_array_equal(np.asarray(g), w)
    # K/V: every row's valid positions (those past a row's length are invalid whatever they hold)
    for g, w in zip((got["cache"].k_lbskh, got["cache"].v_lbskh), want[:2]):
        for row, n in enumerate(want[2]):
            np.testing.assert_array_equal(np.asarray(g)[:, row, :n], w[:, row, :n])
    assert int(got["step"]) == 7
    # ops past ``count`` are not applied
    none = fn(tree, jnp.asarray(padded), 0)
    np.testing.assert_array_equal(np.asarray(none["seq"]), np.asarray(tree["seq"]))


def test_a_swap_moves_only_the_longer_rows_valid_positions():
    """Positions at or past both rows' lengths stay where they are: a swap's work follows the
    requests' lengths, not the cache's (the whole row moved was 8 MB of the demo target's)."""
    tree = _tree()
    cache = tree["cache"]
    lengths = np.array(cache.lengths)
    lengths[[1, 6]] = [5, 20]
    tree["cache"] = KVCache(cache.k_lbskh, cache.v_lbskh, jnp.asarray(lengths))
    k0 = np.array(cache.k_lbskh)
    got = jax.jit(lambda t, o, n: W.apply_row_ops(t, o, n, _mark))(
        tree, jnp.asarray([[1, 6, W.OP_SWAP]] + [[0, 0, 0]] * 15, jnp.int32), 1)
    k = np.asarray(got["cache"].k_lbskh)
    np.testing.assert_array_equal(k[:, 1, :20], k0[:, 6, :20])  # row 6's 20 valid positions
    np.testing.assert_array_equal(k[:, 6, :5], k0[:, 1, :5])
    chunk = W.math.gcd(S, W.SWAP_CHUNK)
    moved = -(-20 // chunk) * chunk
    assert moved < S  # the test's shapes leave positions that must stay
    np.testing.assert_array_equal(k[:, 1, moved:], k0[:, 1, moved:])
    np.testing.assert_array_equal(k[:, 6, moved:], k0[:, 6, moved:])
    assert np.asarray(got["cache"].lengths)[[1, 6]].tolist() == [20, 5]


@pytest.mark.parametrize("layered", [False, True])
def test_the_row_ops_program_never_copies_the_whole_cache(layered):
    """A swap writes two rows in place.  Written as two slices and two updates, XLA fused the read
    of one row into the other's write and copied all of K and V for every operation (35-90 ms a
    free or swap at 32 slots on a CPU, more than a plain round)."""
    tree = _tree(layered=layered)
    fn = jax.jit(lambda t, o, n: W.apply_row_ops(t, o, n, _mark), donate_argnums=0)
    hlo = fn.lower(tree, jnp.zeros((16, 3), jnp.int32), 3).compile().as_text()
    shape = f"f32[{B},{K},{S},{H}]" if layered else f"f32[{L},{B},{S},{K},{H}]"
    copies = [line.strip() for line in hlo.splitlines()
              if re.search(r"=\s*" + re.escape(shape) + r"\S*\s+copy\(", line)]
    assert "while" in hlo  # the loop is there, and its body is what is checked
    assert copies == [], "the row-ops program copies the whole cache:\n" + "\n".join(copies)
